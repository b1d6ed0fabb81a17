"""Alembic's environment for the coordinator's schema. hydrafl runs it itself (`hydrafl.server.migrations`),
on a connection it has already opened and locked: no alembic.ini, no URL read here."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters a table by copying it
)
with context.begin_transaction():
    context.run_migrations()
