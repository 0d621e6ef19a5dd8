"""The store: the only code that runs SQL (the database is the source of truth for job state).

* :mod:`.tables` — the tables (SQLAlchemy 2 declarative models);
* :mod:`.core` — :class:`~broker.service.store.core.JobStore`: engine, sessions, migrations, jobs, schedules,
  logs and nodes, with every job state change a compare-and-set on ``jobs.version``;
* :mod:`.tokens` — API tokens and the audit log (rows only; the rules are :mod:`broker.service.tokens`),
  :class:`~broker.service.store.tokens.Principal` and :func:`~broker.service.store.tokens.hash_token`;
* :mod:`.migrations` — the Alembic revisions, applied by ``JobStore.migrate``.

Repositories are modules of functions that take the :class:`~sqlalchemy.orm.Session` they run in, so the
caller keeps its transaction boundaries; they import the tables and each other, never the rest of the service.
"""
