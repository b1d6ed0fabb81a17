"""Administration from another machine: `admin_tokens` holds the administrators' token hashes (never a site's),
`runs.stop_requested` says that an administrator asked a run to stop ("round": at the end of the current
round, "now": at once; "" when nobody did), and `runs.app_bundle` holds a stock app run's Flower app bundle.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(
            sa.Column("stop_requested", sa.String(8), nullable=False, server_default="")
        )
        batch.add_column(sa.Column("app_bundle", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("app_bundle")
        batch.drop_column("stop_requested")
    op.drop_table("admin_tokens")
