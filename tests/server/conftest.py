"""The coordinator's database in both engines it supports: SQLite, and a real PostgreSQL server on loopback."""

from __future__ import annotations

import pytest
from postgres_server import postgres_server
from sqlalchemy import create_engine, text

from hydrafl.server.tables import Base


@pytest.fixture(scope="module")
def postgres_url():
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def db_url(request, tmp_path) -> str:
    """A fresh, empty database: SQLite in tmp_path, or the module's PostgreSQL server (started as a process of its
    own: slow)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    url = request.getfixturevalue("postgres_url")
    engine = create_engine(url)
    Base.metadata.drop_all(
        engine
    )  # each test starts from an empty database, its schema revision included
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE IF EXISTS alembic_version"))
    return url
