"""The store: the only code that runs SQL (the database is the source of truth for job state).

* :mod:`.tables` — the tables (SQLAlchemy 2 declarative models);
* :mod:`.core` — :class:`~broker.service.store.core.JobStore`: engine, sessions, migrations, jobs, schedules,
  logs and nodes, with every job state change a compare-and-set on ``jobs.version``;
* :mod:`.migrations` — the Alembic revisions, applied by ``JobStore.migrate``.
"""
