"""Where cloud jobs run: one module per provider (``aws``, ``gcp``) behind :mod:`providers.registry`.

* :mod:`.base` — the adapter interface (``Compute``), typed provider errors, idempotency tokens, tags;
* :mod:`.aws`, :mod:`.gcp` — the adapters, their factories from settings, offer checks, Terraform outputs;
* :mod:`.registry` — one line per provider: adapter factory, settings section, offer source;
* :mod:`.provisioner` — failover over ranked options and gang creation (all or nothing);
* :mod:`.launch` — the launch spec and the cloud-init launcher an instance runs; :mod:`.nvml` — GPU telemetry.

Nothing here imports ``broker``.
"""
