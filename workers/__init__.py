"""Long-running processes (node agent, provisioner, reconciler, beat) — arrive with the live-broker issue."""
