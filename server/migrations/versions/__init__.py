"""The coordinator schema's revisions, oldest first: Alembic reads them as files (this module is skipped)."""
