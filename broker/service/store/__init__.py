"""The store: the only code that runs SQL (the database is the source of truth for job state).

* :mod:`.tables` — the tables (SQLAlchemy 2 declarative models);
* :mod:`.core` — :class:`~broker.service.store.core.JobStore`: engine, sessions, migrations, jobs, schedules,
  logs and nodes, with every job state change a compare-and-set on ``jobs.version``;
* :mod:`.tokens` — API tokens and the audit log (rows only; the rules are :mod:`broker.service.tokens`),
  :class:`~broker.service.store.tokens.Principal` and :func:`~broker.service.store.tokens.hash_token`;
* :mod:`.planning` — the rows the planning cycle reads and writes (intake, snapshot, apply, notes);
* :mod:`.nodes` — what the node API's long-poll watches (the jobs on nodes);
* :mod:`.usage` — the usage ledger's rows (``usage_records``): add once per key, read back;
* :mod:`.quota` — the error a submit over the team's queued-jobs quota raises;
* :mod:`.migrations` — the Alembic revisions, applied by ``JobStore.migrate``.

Repositories are modules of functions that take the :class:`~sqlalchemy.orm.Session` they run in, so the
caller keeps its transaction boundaries; they import the tables and each other, never the rest of the service.
"""
