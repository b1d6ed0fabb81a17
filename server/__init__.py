"""Coordinator: gRPC service, Grid over it, SQLAlchemy store (see issue 4)."""
