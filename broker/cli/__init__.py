"""The ``fedbroker`` command line, one module per command group.

* :mod:`.main` — the app, ``simulate`` and ``offers``, and the shared console;
* :mod:`.jobs` — the commands of a live broker's users (submit, status, list, cancel, logs, explain, tokens, schedules);
* :mod:`.cloud` — ``fedbroker cloud``; :mod:`.nodes` — ``fedbroker nodes``;
* :mod:`.serve` — ``fedbroker serve``: the processes of the live broker, wired together.
"""
