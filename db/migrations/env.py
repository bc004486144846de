"""Alembic environment: run with the connection db.store hands over (see db/store.py)."""

from alembic import context

from db.models import Base

VERSION_TABLE = "moesweep_alembic_version"

config = context.config
connection = config.attributes.get("connection")


def run() -> None:
    if connection is None:  # `alembic` CLI use: build an engine from the URL
        from sqlalchemy import create_engine

        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.connect() as conn:
            _migrate(conn)
    else:
        _migrate(connection)


def _migrate(conn) -> None:
    context.configure(
        connection=conn, target_metadata=Base.metadata, version_table=VERSION_TABLE, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


run()
