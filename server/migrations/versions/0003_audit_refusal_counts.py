"""Refusals of one site in one round are counted on one audit row: `audit_events` gains the round a refusal
answered, a count (1 for every row written before) and the time of the last refusal counted, and an index that
finds a site's latest row of a kind.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("server_round", sa.Integer(), nullable=True))
        batch.add_column(
            sa.Column("count", sa.Integer(), nullable=False, server_default=sa.text("1"))
        )
        batch.add_column(sa.Column("last_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_audit_events_kind_site", ["kind", "site_name", "id"])


def downgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_index("ix_audit_events_kind_site")
        batch.drop_column("last_at")
        batch.drop_column("count")
        batch.drop_column("server_round")
