"""The node side: processes that run on an on-prem GPU host, not in the broker.

* :mod:`workers.agent` — the node agent (``fedbroker serve agent``): heartbeats with NVML telemetry,
  takes its node's work from the node API and reports each attempt's end.
* :mod:`workers.node_client` — its client of the node API: HTTP(S) and a node token, nothing else.
* :mod:`workers.runtime` — job attempts as supervised OS processes on this host;
  :mod:`workers.shim` — the per-attempt supervisor process.
* :mod:`workers.isolation` — who a job runs as and where (user, directories, environment);
  :mod:`workers.dynamic_users` — per-attempt uids of a root agent.

Workers hold no database or Redis URL and import only the wire models (:mod:`broker.model`,
:mod:`broker.schemas`) from ``broker``; the broker imports nothing from here but ``fedbroker serve agent``
(import-linter contracts in ``pyproject.toml``).
"""
