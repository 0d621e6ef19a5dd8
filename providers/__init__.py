"""Where jobs run: the provider interface, the cloud adapters, and how one rank is launched anywhere.

* :mod:`providers.base` — the interface (``Compute``, instance records, the classified provider errors).
* :mod:`providers.aws` — AWS EC2 (``AwsCompute``: launch, quota preflight, orphan sweep).
* :mod:`providers.gcp` — Google Compute Engine (``google-cloud-compute``, REST transport).
* :mod:`providers.provisioner` — provider-neutral failover over a ranked list of options.
* :mod:`providers.launch` — one rank's launch spec: its environment, its ``docker run``, its cloud-init script.
* :mod:`providers.nvml` — this node's GPU inventory and telemetry (NVML, or a deterministic fake).

Imports nothing from ``broker`` (an import-linter contract in ``pyproject.toml``): the service
(:mod:`broker.service.cloud`) and the node agent (:mod:`workers`) use these modules, never the reverse.
"""
