"""A Kubernetes pool of the live broker (issue #14): the planning cycle places a job on the fake API server's
cluster (tests/providers/fake_k8s.py, the real ``kubernetes`` client), the reconciler's watch follows it, on a real
PostgreSQL store: the same service code path as a Slurm pool (broker/service/schedulers.py)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

pytest.importorskip("kubernetes")

from broker.model import JobSpec  # noqa: E402
from broker.service import ledger  # noqa: E402
from broker.service.cycle import PlanningCycle  # noqa: E402
from broker.service.live import LiveEnvironment  # noqa: E402
from broker.service.reconciler import Reconciler  # noqa: E402
from broker.service.schedulers import SchedulerPools  # noqa: E402
from broker.service.settings import BrokerSettings  # noqa: E402
from broker.service.store.core import JobStore  # noqa: E402
from tests.conftest import PG_URL  # noqa: E402
from tests.providers.fake_k8s import FakeK8s  # noqa: E402

A100 = "NVIDIA-A100-SXM4-80GB"


@pytest.fixture
def broker(tmp_path):
    with FakeK8s() as fake:
        for n in ("a001", "a002"):
            fake.add_node(n, 2, A100)
        kc = fake.kubeconfig(tmp_path / "kubeconfig")
        f = tmp_path / "cluster.json"
        f.write_text(json.dumps({"pools": [{
            "name": "k8s", "kind": "kubernetes", "carbon_zone": "CA-ON", "price_zone": "CA-ON", "pue": 1.1,
            "amortised_usd_per_gpu_hour": 0.5,
            "kubernetes": {"kubeconfig": str(kc), "context": "fake", "broker_id": "b-k8s",
                           "gpu_products": {"a100": A100}, "term_grace_s": 1.0}}]}))
        env = LiveEnvironment(BrokerSettings().planner, f)
        ledger.install(ledger.LedgerPrices.from_environment(env))
        store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
        store.migrate()
        st = BrokerSettings(cluster=f, max_attempts=3)
        pools = SchedulerPools(env.site_pools.values(), st)
        try:
            yield store, PlanningCycle(store, env, st, schedulers=pools), Reconciler(store, st, schedulers=pools), pools
        finally:
            ledger.install(None)
            store.drop_schema()


def _until(store, rec, job_id, states, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while True:
        rec.run()
        j = store.get(job_id)
        if j.state in states or time.monotonic() > end:
            return j
        time.sleep(0.1)


def test_job_placed_by_the_planner_on_a_kubernetes_pool_runs_to_succeeded_with_its_log(broker):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", JobSpec(command=["sh", "-c", 'echo "rank=$NODE_RANK of $NNODES"'],
                                            image="busybox:1.36", gpu_types=["A100"], estimated_duration_s=60.0))
    res = cycle.run()
    assert res.kinds == {"start": 1}
    assert res.submitted == {(job.id, 1): f"submitted fb-{job.id}-a1"}
    [att] = store.attempts(job.id)
    assert (att.kind, att.external_id, store.get(job.id).placement["kind"]) == ("kubernetes", f"fb-{job.id}-a1",
                                                                                "kubernetes")
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("succeeded", 0)
    assert store.log_chunks(job.id, 1) == [(0, "rank=0 of 1\n")]
    assert store.attempts(job.id)[0].outcome == "succeeded"


def test_cancel_of_a_job_on_a_kubernetes_pool_deletes_it(broker):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", JobSpec(command=["sh", "-c", "sleep 30"], image="busybox:1.36",
                                            gpu_types=["A100"], estimated_duration_s=60.0))
    cycle.run()
    assert _until(store, rec, job.id, {"running"}).state == "running"
    store.request_cancel(job.id)
    done = _until(store, rec, job.id, {"cancelled", "failed", "succeeded"})
    assert (done.state, done.reason) == ("cancelled", "cancelled by user; deleted in the cluster")
    assert pools.adapter("k8s").list_managed() == []
