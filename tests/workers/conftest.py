"""Fixtures of the tests that run real jobs: ``tmp_path`` is a directory the jobs' unprivileged uids can reach
(the tests run as root), ``env`` the live planning environment, ``rig(nodes)`` agents against a live API."""

import pytest

from broker.service.live import LiveEnvironment
from broker.service.settings import BrokerSettings
from tests.jobdirs import tmp_path  # noqa: F401 - the fixture
from tests.workers.rig import Rig


@pytest.fixture(scope="module")
def env():
    """The live planning environment (bundled signals and offers), built once per module."""
    return LiveEnvironment(BrokerSettings().planner)


@pytest.fixture
def rig(pg_store, env, tmp_path):
    """``rig({"n1": 2, ...}) -> Rig``: node agents with fake GPUs against a live API over ``pg_store``
    (:class:`tests.workers.rig.Rig`); their API servers are stopped afterwards."""
    made = []

    def make(nodes: dict[str, int]):
        made.append(Rig(pg_store, env, tmp_path, nodes))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def _close_rigs():
    """Close every rig a test made (its API server, its agents' nftables tables), fixture or not."""
    yield
    for r in list(Rig.live):
        r.close()
