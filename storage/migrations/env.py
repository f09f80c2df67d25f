"""Alembic environment for tailpilot's store.

Normally run programmatically by :mod:`storage.migrate`, which hands over an open connection in
``config.attributes["connection"]`` (inside its transaction, so a migration and the lock that
serialises concurrent openers share one transaction). Without one (``alembic -x url=...`` or a
``sqlalchemy.url`` option), it builds its own engine the same way the store does.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from storage.engine import make_engine, normalize_url
from storage.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _url() -> str | None:
    return context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )


def run_offline() -> None:
    url = normalize_url(_url())
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(normalize_url(_url()))
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
