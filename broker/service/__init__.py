"""The live broker: the processes that store, plan, dispatch and watch real jobs.

* :mod:`.store` — the only code that runs SQL: tables, :class:`JobStore`, repositories, migrations;
* :mod:`.wiring` — the composition root: what the worker and every API process build from their settings;
* HTTP: :mod:`.api`, :mod:`.api_tokens`, :mod:`.node_api`, :mod:`.work_watch`, :mod:`.jsonbody`,
  :mod:`.httpserver`, :mod:`.limits`, :mod:`.auth_cache`, :mod:`.tokens`, :mod:`.redact`;
* planning and repair: :mod:`.celery_app`, :mod:`.tasks`, :mod:`.cycle`, :mod:`.live`, :mod:`.reconciler`;
* attempts: :mod:`.lifecycle` (what an attempt's end means, every runtime), :mod:`.attempts` (on-prem),
  :mod:`.cloud` (cloud instances: adapters, provision, reports, watch);
* :mod:`.settings` — the one typed settings schema.
"""
