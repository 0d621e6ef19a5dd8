"""The live broker: the processes that store, plan, dispatch and watch real jobs.

* state: :mod:`.db` (tables), :mod:`.store` (the only code that runs SQL), :mod:`.migrations`;
* HTTP: :mod:`.api`, :mod:`.api_tokens`, :mod:`.node_api`, :mod:`.work_watch`, :mod:`.jsonbody`,
  :mod:`.httpserver`, :mod:`.limits`, :mod:`.auth_cache`, :mod:`.tokens`, :mod:`.redact`;
* planning and repair: :mod:`.celery_app`, :mod:`.tasks`, :mod:`.cycle`, :mod:`.live`, :mod:`.reconciler`;
* attempts: :mod:`.attempts` (on-prem), :mod:`.cloud` (cloud instances);
* :mod:`.settings` — the one typed settings schema.
"""
