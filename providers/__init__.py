"""Where jobs run: the provider interface, the cloud adapters behind one registry, and how one rank is launched anywhere.

* :mod:`.base` — the adapter interface (``Compute``, instance records, the classified provider errors,
  idempotency tokens, tags);
* :mod:`.aws`, :mod:`.gcp` — the adapters (AWS EC2; Google Compute Engine through ``google-cloud-compute``),
  their factories from settings, offer checks and Terraform outputs;
* :mod:`.slurm`, :mod:`.kubernetes` — an existing Slurm or Kubernetes cluster as a pool (capacity, submit,
  describe, cancel, sweep), sharing ``PoolJobRequest``/``PoolJobInfo``/``NodeCapacity`` of :mod:`.base`;
* :mod:`.registry` — one line per provider: adapter factory, settings section, offer source;
* :mod:`.provisioner` — provider-neutral failover over ranked options and gang creation (all or nothing);
* :mod:`.launch` — one rank's launch spec: its environment, its ``docker run``, its cloud-init launcher;
* :mod:`.nvml` — this node's GPU inventory and telemetry (NVML, or a deterministic fake).

Imports nothing from ``broker`` (an import-linter contract in ``pyproject.toml``): the service
(:mod:`broker.service.cloud`) and the node agent (:mod:`workers`) use these modules, never the reverse.
"""
