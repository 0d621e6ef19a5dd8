"""One real local Slurm per test module (``tests/slurm/cluster.py``); skipped where it cannot run (not root, or
the Debian packages are missing: ``.ci/run`` installs them)."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import LocalSlurm, slurm_available


@pytest.fixture(scope="module")
def slurm_cluster():
    """A started :class:`LocalSlurm` (3 nodes x 2 a100, 1 node x 4 h100, partition ``gpu``, MaxTime 60 min,
    MaxNodes 2); stopped and deleted after the module, leaving no daemon behind."""
    why = slurm_available()
    if why:
        pytest.skip(why)
    cluster = LocalSlurm().start()
    try:
        yield cluster
    finally:
        pids = cluster.pids()
        cluster.cleanup()
        assert not LocalSlurm.alive(pids), f"local Slurm daemons left running: {pids}"
