"""Coordinator: gRPC service, the Grid over it, SQLAlchemy store, blob store, limits, TLS."""
