"""Alembic environment of the job store.

Run through :meth:`broker.service.store.core.JobStore.migrate`, which passes an open
connection in ``config.attributes["connection"]``; ``alembic`` on the command
line works too with ``-x url=postgresql+psycopg://...``.
"""

from alembic import context
from sqlalchemy import create_engine

from broker.service.store.tables import Base

target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


conn = context.config.attributes.get("connection")
if conn is not None:
    _run(conn)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("alembic: give the database with -x url=... (e.g. sqlite:///.fedbroker/fedbroker.db)")
    engine = create_engine(url)
    with engine.connect() as c:
        _run(c)
        c.commit()
