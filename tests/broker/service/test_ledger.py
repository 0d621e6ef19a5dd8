"""The usage ledger (issue #12, items 1-2): hand-worked records written by the one attempt lifecycle, on real
PostgreSQL and SQLite.

Every expected figure is worked by hand in the test's comments from the prices, counters and grid values the
test sets (no figure is read back from the code under test).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from sqlalchemy import func, select, update

from broker.model import CloudOffer, JobSpec, Market, Pool, PoolNode
from broker.service import ledger, lifecycle
from broker.service.lifecycle import Place
from broker.service.store import attempts as repo
from broker.service.store import usage
from broker.service.store.core import JobNotFound, JobStore
from broker.service.store.tables import Attempt, CloudInstance, Job, Node, UsageRow
from broker.usage import UsageError, UsageRecord
from pricing.series import HourlySeries
from tests.broker.service import test_cloud as tc
from tests.broker.service.test_cloud import net, settings  # noqa: F401 (fixtures: moto EC2 and its settings)

UTC = timezone.utc
DAY0 = datetime(2024, 3, 5, tzinfo=UTC)
IMAGE = "ghcr.io/fedbroker/nccl-train@sha256:" + "ab" * 32

AWS_OD = CloudOffer(provider="aws", region="us-east-1", zone="use1-az6", instance_type="p3.2xlarge", gpu_type="V100",
                    gpu_count=1, gpu_memory_gb=16, market=Market.on_demand, usd_per_hour=3.06, carbon_zone="AWS-ZONE",
                    pue=1.15)
GCP_SPOT = CloudOffer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-1g",
                      gpu_type="A100", gpu_count=1, gpu_memory_gb=40, market=Market.spot, usd_per_hour=1.2,
                      carbon_zone="GCP-ZONE", pue=1.1)
AWS_SPOT = CloudOffer(provider="aws", region="us-east-1", zone="use1-az6", instance_type="p3.2xlarge", gpu_type="V100",
                      gpu_count=1, gpu_memory_gb=16, market=Market.spot, usd_per_hour=0.9, carbon_zone="AWS-ZONE",
                      pue=1.15)
GCP_OD = CloudOffer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-1g",
                   gpu_type="A100", gpu_count=1, gpu_memory_gb=40, market=Market.on_demand, usd_per_hour=3.6,
                   carbon_zone="GCP-ZONE", pue=1.1)
POOL = Pool(name="site", carbon_zone="SITE", price_zone="SITE", pue=1.2, amortised_usd_per_gpu_hour=0.5,
            nodes=(PoolNode(name="n1", gpu_type="V100", gpu_count=4),))
NY = Pool(name="ny", carbon_zone="NY", price_zone="NY", pue=1.0, amortised_usd_per_gpu_hour=0.5,
          timezone="America/New_York", nodes=(PoolNode(name="m1", gpu_type="V100", gpu_count=1),))


def hourly(zone: str, unit: str, values_by_hour: dict[int, float], default: float, hours: int = 48,
           start: datetime = DAY0) -> HourlySeries:
    vals = np.full(hours, default, dtype=float)
    for h, v in values_by_hour.items():
        vals[h] = v
    return HourlySeries(zone, unit, start.timestamp(), vals)


class Signals:
    """Grid signals on real instants: constant carbon per zone unless given, tariffs as given."""

    def __init__(self, carbon: dict[str, HourlySeries], price: dict[str, HourlySeries]):
        self._c, self._p = carbon, price

    def carbon(self, zone):
        if zone not in self._c:
            raise ValueError(f"zone={zone!r}: unknown")
        return self._c[zone]

    def price(self, zone):
        return self._p.get(zone)


def install(carbon=None, price=None, offers=(AWS_OD, GCP_SPOT, AWS_SPOT, GCP_OD), pools=(POOL, NY)):
    c = {"AWS-ZONE": hourly("AWS-ZONE", "gCO2e/kWh", {}, 400.0),
         # GCP zone: 300 gCO2e/kWh in hour 10 of DAY0, 500 in hour 11
         "GCP-ZONE": hourly("GCP-ZONE", "gCO2e/kWh", {10: 300.0, 11: 500.0}, 999.0),
         "SITE": hourly("SITE", "gCO2e/kWh", {}, 100.0)}
    # site tariff: 100 USD/MWh in hour 14 of DAY0, 300 in hour 15
    p = {"SITE": hourly("SITE", "USD/MWh", {14: 100.0, 15: 300.0}, 50.0)}
    c.update(carbon or {})
    p.update(price or {})
    ledger.install(ledger.LedgerPrices.of(offers, pools, Signals(c, p)))


@pytest.fixture(autouse=True)
def _prices():
    install()
    yield
    ledger.install(None)


def spec(nodes=1, gpus=1, gpu="V100") -> JobSpec:
    return JobSpec(image=IMAGE, command=["python", "train.py"], gpus_per_node=gpus, nodes=nodes, gpu_types=[gpu],
                   estimated_duration_s=3600, checkpoint_interval_s=600)


def iid(jid: str, attempt: int, rank: int) -> str:
    """The provider instance id the tests give rank ``rank`` of attempt ``attempt`` of ``jid``."""
    return f"i-{jid}-{attempt}-{rank}"


def _to_starting_cloud(store: JobStore, jid: str, offer: CloudOffer, attempt: int, created: datetime, nodes: int):
    with store.session() as s:
        j = s.get(Job, jid)
        placement = {"kind": "cloud", "offer_id": offer.offer_id, "provider": offer.provider, "region": offer.region,
                     "zone": offer.zone, "instance_type": offer.instance_type, "market": offer.market.value,
                     "gpu_type": offer.gpu_type}
        assert JobStore.cas(s, jid, j.version, "queued", "provisioning", "test", created, attempt=attempt,
                            placement=placement)
        parts = [{"rank": r, "instance_id": iid(jid, attempt, r), "node": f"{offer.provider}/i-{attempt}-{r}"}
                 for r in range(nodes)]
        s.add(Attempt(job_id=jid, number=attempt, kind="cloud", pool=None, offer_id=offer.offer_id, nodes=parts,
                      gpu_type=offer.gpu_type, gpus=nodes * offer.gpu_count, created_at=created, rank_exits={},
                      reason=""))
        for r in range(nodes):
            s.add(CloudInstance(job_id=jid, attempt=attempt, rank=r, offer_id=offer.offer_id, provider=offer.provider,
                                region=offer.region, zone=offer.zone, instance_type=offer.instance_type,
                                market=offer.market.value, idempotency_token=uuid.uuid4().hex, state="running",
                                provider_instance_id=iid(jid, attempt, r), created_at=created, updated_at=created,
                                history=[], launch_usd_per_hour=offer.usd_per_hour))
        s.flush()
        s.refresh(j)
        assert JobStore.cas(s, jid, j.version, "provisioning", "starting", "created", created,
                            placement={**placement, "nodes": parts})


def cloud_job(store: JobStore, offer: CloudOffer, created: datetime, nodes: int = 1) -> str:
    view, _ = store.submit("ml", spec(nodes=nodes, gpu=offer.gpu_type), now=created)
    with store.session() as s:
        j = s.get(Job, view.id)
        assert JobStore.cas(s, j.id, j.version, "submitted", "queued", "accepted", created)
    _to_starting_cloud(store, view.id, offer, 1, created, nodes)
    return view.id


def run_ranks(store: JobStore, jid: str, attempt: int, started: datetime, ends: list[tuple[int, int | None, datetime]],
              cloud: bool = True) -> list[str]:
    """Mark the attempt running at ``started`` (unless it is running already), then end ranks ``(rank, exit
    code, at)`` in order."""
    outs = []
    with store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, attempt)
        if j.state == "starting":
            assert lifecycle.mark_running(s, j, att, started, "running")
    for rank, code, at in ends:
        with store.session() as s:
            j, att = s.get(Job, jid), repo.attempt_row(s, jid, attempt, lock=True)
            place = Place.instance(f"rank {rank}") if cloud else Place.node(rank, "n1")
            outs.append(lifecycle.rank_ended(s, j, att, rank, code, at, place, max_attempts=5).outcome)
    return outs


def records(store: JobStore, jid: str) -> list[UsageRecord]:
    with store.session() as s:
        return usage.usage_rows(s, jid)


# ----------------------------------------------------------------------------- cloud

def test_a_45_second_aws_job_is_billed_60_seconds(any_store):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    assert run_ranks(any_store, jid, 1, t0 + timedelta(seconds=20), [(0, 0, t0 + timedelta(seconds=45))]) == [
        "succeeded"]
    [r] = records(any_store, jid)
    assert (r.line, r.resource, r.provider, r.zone, r.instance_type, r.market, r.team) == (
        "instance", iid(jid, 1, 0), "aws", "use1-az6", "p3.2xlarge", "on_demand", "ml")
    assert (r.start, r.end, r.run_s, r.billed_s) == (t0, t0 + timedelta(seconds=45), 45.0, 60.0)
    # 3.06 USD/h x 60 s / 3600 = 0.051 USD
    assert (r.list_unit_price_usd, r.pricing_unit) == (3.06, "Hours") and r.billed_usd == pytest.approx(0.051, abs=1e-12)
    # modelled V100 power 274 W (40 W idle + 0.9 x 260 W) x PUE 1.15 = 0.3151 kW; x 45 s = 0.00393875 kWh;
    # x 400 gCO2e/kWh = 1.5755 gCO2e
    assert r.energy_kwh == pytest.approx(0.00393875, rel=1e-9)
    assert r.carbon_kg == pytest.approx(0.0015755, rel=1e-9)
    assert r.estimated and "power modelled" in r.estimate_reasons[0]


def test_a_two_node_gcp_spot_job_across_an_hour_boundary(any_store):
    t0 = DAY0 + timedelta(hours=10, minutes=50)
    t1 = DAY0 + timedelta(hours=11, minutes=20)
    jid = cloud_job(any_store, GCP_SPOT, t0, nodes=2)
    assert run_ranks(any_store, jid, 1, t0 + timedelta(minutes=2), [(1, 0, t1), (0, 0, t1)]) == [
        "rank done", "succeeded"]
    rs = records(any_store, jid)
    assert [(r.rank, r.resource, r.market, r.run_s, r.billed_s) for r in rs] == [
        (0, iid(jid, 1, 0), "spot", 1800.0, 1800.0), (1, iid(jid, 1, 1), "spot", 1800.0, 1800.0)]
    # each: 1.2 USD/h x 0.5 h = 0.60 USD; the gang 1.20 USD
    assert [r.billed_usd for r in rs] == pytest.approx([0.6, 0.6], abs=1e-12)
    # modelled A100 365 W x PUE 1.1 = 0.4015 kW; 0.20075 kWh each
    # carbon: 10 min at 300 + 20 min at 500 gCO2e/kWh = 50 + 166.667 = 216.667 gCO2e/kWh x h
    # -> 0.4015 x 216.667 / 1000 = 0.0869917 kgCO2e each
    assert [r.energy_kwh for r in rs] == pytest.approx([0.20075, 0.20075], rel=1e-9)
    assert [r.carbon_kg for r in rs] == pytest.approx([0.4015 * (50 + 500 / 3) / 1000] * 2, rel=1e-9)


def test_a_spot_attempt_interrupted_and_resumed_meters_both_attempts_once(any_store):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_SPOT, t0)
    with any_store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
        assert lifecycle.mark_running(s, j, att, t0 + timedelta(seconds=60), "running")
        s.refresh(j)
        assert repo.bump_with_event(s, j, t0 + timedelta(seconds=1190), "spot notice", stop_reason="spot")
    with any_store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1, lock=True)
        end1 = t0 + timedelta(seconds=1200)
        assert lifecycle.rank_ended(s, j, att, 0, 143, end1, Place.instance("rank 0"), max_attempts=5).outcome == "requeued"
    assert any_store.get(jid).state == "queued"
    t2 = t0 + timedelta(hours=1)
    _to_starting_cloud(any_store, jid, AWS_SPOT, 2, t2, 1)
    assert run_ranks(any_store, jid, 2, t2 + timedelta(seconds=60), [(0, 0, t2 + timedelta(seconds=900))]) == [
        "succeeded"]
    # the replayed end of attempt 1 (an instance report sent twice) and of attempt 2 write nothing more
    with any_store.session() as s:
        for n, at in ((1, end1), (2, t2 + timedelta(seconds=900))):
            att = repo.attempt_row(s, jid, n)
            assert lifecycle.close_attempt(s, att, at, "succeeded") is False
            assert lifecycle.record_usage(s, att, at) == 0
    rs = records(any_store, jid)
    # attempt 1: 1200 s x 0.9 USD/h = 0.30 USD; attempt 2: 900 s = 0.225 USD
    assert [(r.attempt, r.resource, r.run_s, r.billed_usd) for r in rs] == [
        (1, iid(jid, 1, 0), 1200.0, pytest.approx(0.3)), (2, iid(jid, 2, 0), 900.0, pytest.approx(0.225))]
    assert rs[0].end <= rs[1].start  # nothing metered twice
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(UsageRow)) == 2


def _teardown(store: JobStore, jid: str, attempt: int, at: datetime, ok: bool) -> None:
    """The teardown's terminate call at ``at`` for every instance of the attempt: ``ok`` deletes them (rows
    ``terminated``, their usage in the same transaction, as :meth:`CloudBroker.teardown` does), else it failed
    (rows ``terminating``: the instances still exist)."""
    from broker.service.store import cloud as instances

    with store.session() as s:
        for row_id, *_ in instances.live_rows(s, jid, attempt):
            instances.end_teardown(s, row_id, "terminated" if ok else "terminating", "the attempt ended", at,
                                   lambda e: False)
        if ok:
            lifecycle.record_instance_usage(s, jid, attempt, at)


def test_a_stopped_instances_disk_bills_until_the_instance_is_deleted_its_compute_not(any_store):
    """GCP a2-highgpu-1g on-demand (3.60 USD/h) with the default 200 GiB pd-balanced boot disk, us-central1
    (the priced region). Created 09:00, running 09:05; at 10:00 the watch finds it stopped: the attempt ends
    (interrupted), the terminate call fails; the retry deletes it at 13:00."""
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, GCP_OD, t0)
    with any_store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
        assert lifecycle.mark_running(s, j, att, t0 + timedelta(minutes=5), "running")
    stop = t0 + timedelta(hours=1)
    with any_store.session() as s:  # what CloudBroker.watch does on a 'stopped' instance
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1, lock=True)
        lifecycle.note_instance_stopped(att, iid(jid, 1, 0), stop)
        assert lifecycle.requeue_lost(s, j, stop, "instance gone (stopped)", "interrupted", max_attempts=5)
    _teardown(any_store, jid, 1, stop, ok=False)
    assert [r.line for r in records(any_store, jid)] == ["instance"]  # the disk bills on: not metered yet
    _teardown(any_store, jid, 1, t0 + timedelta(hours=4), ok=True)
    inst, disk = records(any_store, jid)[1], records(any_store, jid)[0]
    assert [r.line for r in records(any_store, jid)] == ["disk", "instance"]  # no idle line: stopped, no compute
    # the instance: 09:00-10:00, 3600 s x 3.60 USD/h = 3.60 USD
    assert (inst.start, inst.end, inst.billed_s, inst.billed_usd) == (t0, stop, 3600.0, pytest.approx(3.6))
    # the disk: 09:00-13:00 = 14,400 s; 200 GiB x 14,400 / 2,678,400 s (GCP's GiB-month) = 1.0752688 GiB-months
    # x 0.10 USD = 0.10752688 USD; GB-Months priced, no GPU, no modelled power
    assert (disk.start, disk.end, disk.run_s, disk.billed_s, disk.pricing_unit, disk.list_unit_price_usd) == (
        t0, t0 + timedelta(hours=4), 14400.0, 14400.0, "GB-Months", 0.10)
    assert disk.billed_usd == pytest.approx(200 * 14400 / 2678400 * 0.10, rel=1e-12)
    assert disk.billed_usd == pytest.approx(0.10752688, abs=1e-8)
    assert (disk.gpu_count, disk.energy_kwh, disk.carbon_kg, disk.estimated, disk.resource) == (
        0, 0.0, 0.0, False, iid(jid, 1, 0))
    # the deletion replayed (the reconciler's next pass) writes nothing more
    with any_store.session() as s:
        assert lifecycle.record_instance_usage(s, jid, 1, t0 + timedelta(hours=5)) == 0


def test_an_instance_left_running_after_its_job_bills_the_gap_as_an_idle_line(any_store):
    """AWS p3.2xlarge on-demand (3.06 USD/h), 200 GB gp3 boot disk, us-east-1. Created 09:00, the job runs
    09:01-10:00 and succeeds; the terminate call fails, the retry deletes the instance at 12:00: two hours
    billed that no job used."""
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    end = t0 + timedelta(hours=1)
    assert run_ranks(any_store, jid, 1, t0 + timedelta(minutes=1), [(0, 0, end)]) == ["succeeded"]
    _teardown(any_store, jid, 1, end, ok=False)
    _teardown(any_store, jid, 1, t0 + timedelta(hours=3), ok=True)
    disk, idle, inst = records(any_store, jid)
    assert (disk.line, idle.line, inst.line) == ("disk", "idle", "instance")
    # the job: 09:00-10:00 = 3.06 USD; idle: 10:00-12:00, 7,200 s x 3.06 USD/h = 6.12 USD: together the
    # instance's bill, 3 h x 3.06 = 9.18 USD
    assert (inst.end, inst.billed_usd) == (end, pytest.approx(3.06))
    assert (idle.start, idle.end, idle.run_s, idle.billed_s) == (end, t0 + timedelta(hours=3), 7200.0, 7200.0)
    assert idle.billed_usd == pytest.approx(6.12, abs=1e-12)
    assert inst.billed_usd + idle.billed_usd == pytest.approx(3.06 * 3, abs=1e-12)
    # idle power: V100 idle 40 W x PUE 1.15 = 0.046 kW x 2 h = 0.092 kWh; x 400 gCO2e/kWh = 0.0368 kgCO2e
    assert (idle.energy_kwh, idle.carbon_kg) == (pytest.approx(0.092), pytest.approx(0.0368))
    assert (idle.team, idle.job_id, idle.estimated) == ("ml", jid, True)
    assert idle.estimate_reasons == ("power modelled (1 x V100 idle x PUE 1.15): cloud instances give no energy counter",)
    # the disk: 09:00-12:00 = 10,800 s in March (31 days = 2,678,400 s): 200 GB x 10,800 / 2,678,400 =
    # 0.80645161 GB-months x 0.08 USD = 0.06451613 USD
    assert (disk.start, disk.end, disk.billed_s) == (t0, t0 + timedelta(hours=3), 10800.0)
    assert disk.billed_usd == pytest.approx(0.0645161290, abs=1e-10)


def test_an_instance_no_job_ran_on_is_all_idle(any_store):
    """An attempt that timed out starting (created 09:00, never running, ended 09:20, deleted 09:20:30): the
    whole 1,230 s of the instance is idle, 1,230 s x 3.06 USD/h = 1.0455 USD; its disk 1,230 s."""
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    with any_store.session() as s:
        j = s.get(Job, jid)
        assert lifecycle.requeue_lost(s, j, t0 + timedelta(minutes=20), "start deadline", "timed_out", max_attempts=5)
    assert records(any_store, jid) == []
    _teardown(any_store, jid, 1, t0 + timedelta(minutes=20, seconds=30), ok=True)
    disk, idle = records(any_store, jid)
    assert (idle.line, idle.start, idle.run_s, idle.billed_s) == ("idle", t0, 1230.0, 1230.0)
    assert idle.billed_usd == pytest.approx(1.0455, abs=1e-12)
    assert (disk.line, disk.billed_s) == ("disk", 1230.0)


# ----------------------------------------------------------------------------- on-prem

def _node(s, name: str, pool: str, at: datetime, energy_mj: list[int | None], power_w: list[float | None]):
    tel = {"gpus": [{"index": i, "energy_mj": e, "power_w": p} for i, (e, p) in enumerate(zip(energy_mj, power_w))]}
    n = s.get(Node, name)
    if n is None:
        s.add(Node(name=name, pool=pool, gpu_type="V100", gpu_count=len(energy_mj), gpu_memory_gb=16,
                   healthy_gpus=list(range(len(energy_mj))), state="up", agent_id="a", registered_at=at,
                   last_heartbeat_at=at, telemetry=tel))
    else:
        n.last_heartbeat_at, n.telemetry = at, tel


def onprem_job(store: JobStore, pool: str, node: str, gpus: list[int], at: datetime) -> str:
    from broker.service.store import planning

    view, _ = store.submit("vision", spec(gpus=len(gpus)), now=at)
    with store.session() as s:
        j = s.get(Job, view.id)
        assert JobStore.cas(s, j.id, j.version, "submitted", "queued", "accepted", at)
        s.refresh(j)
        parts = [{"node": node, "gpus": gpus, "rank": 0}]
        assert JobStore.cas(s, j.id, j.version, "queued", "starting", "placed", at, attempt=1,
                            placement={"kind": "onprem", "pool": pool, "gpu_type": "V100", "nodes": parts})
        planning.add_onprem_attempt(s, j.id, 1, pool, parts, "V100", at)
    return view.id


def test_an_onprem_job_is_priced_from_the_energy_counter_across_a_tariff_change(any_store):
    t0, t1 = DAY0 + timedelta(hours=14, minutes=30), DAY0 + timedelta(hours=15, minutes=30)
    with any_store.session() as s:
        _node(s, "n1", "site", t0, [5_000_000, 7_000_000, 0, 0], [250.0, 300.0, 40.0, 40.0])
    jid = onprem_job(any_store, "site", "n1", [0, 1], t0)
    with any_store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
        assert lifecycle.mark_running(s, j, att, t0, "running on n1")
    # an hour later: GPU 0 drew 900 kJ (250 W), GPU 1 1080 kJ (300 W)
    with any_store.session() as s:
        _node(s, "n1", "site", t1, [905_000_000, 1_087_000_000, 1, 1], [250.0, 300.0, 40.0, 40.0])
    assert run_ranks(any_store, jid, 1, t0, [(0, 0, t1)], cloud=False) == ["succeeded"]
    amortised, energy = sorted(records(any_store, jid), key=lambda r: r.line)
    assert (amortised.line, energy.line) == ("amortised", "energy")
    # IT energy 0.25 + 0.30 = 0.55 kWh; x PUE 1.2 = 0.66 kWh
    assert (energy.provider, energy.pool, energy.gpu_count, energy.run_s) == ("onprem", "site", 2, 3600.0)
    assert energy.energy_kwh == pytest.approx(0.66, rel=1e-12)
    # tariff: 30 min at 100 + 30 min at 300 USD/MWh = 200 USD/MWh x h; 0.66 kW x 200 / 1000 = 0.132 USD
    assert energy.billed_usd == pytest.approx(0.132, rel=1e-12)
    assert (energy.list_unit_price_usd, energy.pricing_unit) == (pytest.approx(0.2), "kWh")  # the mean tariff
    # carbon: 0.66 kWh x 100 gCO2e/kWh = 0.066 kgCO2e
    assert energy.carbon_kg == pytest.approx(0.066, rel=1e-12)
    assert not energy.estimated and energy.estimate_reasons == ()
    # amortised: 2 GPUs x 1 h x 0.5 USD/GPU-h = 1.00 USD, its own line, no energy
    assert (amortised.billed_usd, amortised.energy_kwh, amortised.carbon_kg) == (pytest.approx(1.0), 0.0, 0.0)
    assert (amortised.list_unit_price_usd, amortised.pricing_unit) == (0.5, "GPU-Hours")
    assert not amortised.estimated


def test_a_local_time_tariff_across_the_fall_back_change_is_priced_by_the_hours_that_happened(any_store):
    # New York, 2024-11-03: 01:00-02:00 local happens twice (EDT, then EST). Local hourly tariff (USD/MWh):
    # 00:00 EDT 50, 01:00 EDT 70, 01:00 EST 90, 02:00 EST 110 -> UTC 04:00 50, 05:00 70, 06:00 90, 07:00 110
    local = [datetime(2024, 11, 3, h) for h in (0, 1, 1, 2)]
    tariff = HourlySeries.from_local(local, [50.0, 70.0, 90.0, 110.0], tz="America/New_York", zone="NY",
                                     unit="USD/MWh")
    day = datetime(2024, 11, 3, tzinfo=UTC)
    install(carbon={"NY": hourly("NY", "gCO2e/kWh", {}, 200.0, start=day)}, price={"NY": tariff})
    t0, t1 = day + timedelta(hours=4, minutes=30), day + timedelta(hours=6, minutes=30)  # 00:30 EDT .. 01:30 EST
    with any_store.session() as s:
        _node(s, "m1", "ny", t0, [0], [1000.0])
    jid = onprem_job(any_store, "ny", "m1", [0], t0)
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, jid), repo.attempt_row(s, jid, 1), t0, "running")
        _node(s, "m1", "ny", t1, [7_200_000_000], [1000.0])  # 1 kW for 2 h = 7.2 MJ
    run_ranks(any_store, jid, 1, t0, [(0, 0, t1)], cloud=False)
    amortised, energy = sorted(records(any_store, jid), key=lambda r: r.line)
    # 2 h of local wall clock that reads "00:30 -> 01:30": 2 kWh (PUE 1.0);
    # tariff 0.5 h x 50 + 1 h x 70 + 0.5 h x 90 = 140 USD/MWh x h -> 1 kW x 140 / 1000 = 0.14 USD
    assert (energy.run_s, energy.energy_kwh) == (7200.0, pytest.approx(2.0))
    assert energy.billed_usd == pytest.approx(0.14, rel=1e-12)
    assert energy.carbon_kg == pytest.approx(0.4)  # 2 kWh x 200 g
    assert amortised.billed_usd == pytest.approx(1.0)  # 1 GPU x 2 h x 0.5


def test_a_gpu_without_a_counter_is_metered_from_sampled_power_and_flagged(any_store):
    t0, t1 = DAY0 + timedelta(hours=2), DAY0 + timedelta(hours=3)
    with any_store.session() as s:
        _node(s, "n1", "site", t0, [None, None, None, None], [200.0, 200.0, 40.0, 40.0])
    jid = onprem_job(any_store, "site", "n1", [0], t0)
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, jid), repo.attempt_row(s, jid, 1), t0, "running")
        _node(s, "n1", "site", t1, [None, None, None, None], [300.0, 200.0, 40.0, 40.0])
    run_ranks(any_store, jid, 1, t0, [(0, 0, t1)], cloud=False)
    _, energy = sorted(records(any_store, jid), key=lambda r: r.line)
    # mean of the samples 250 W x 1 h x PUE 1.2 = 0.3 kWh; at 50 USD/MWh = 0.015 USD
    assert energy.energy_kwh == pytest.approx(0.3) and energy.billed_usd == pytest.approx(0.015)
    assert energy.estimated and energy.estimate_reasons == ("GPU 0: no energy counter; mean of 2 power sample(s)",)


def test_a_missing_tariff_hour_is_interpolated_and_flagged_a_wide_gap_is_unknown_never_zero(any_store):
    gap = hourly("SITE", "USD/MWh", {14: 100.0, 15: float("nan"), 16: 300.0}, 50.0)
    for k in range(20, 30):
        gap.values[k] = float("nan")
    gap = HourlySeries("SITE", "USD/MWh", gap.start_s, gap.values)
    install(price={"SITE": gap})
    with any_store.session() as s:
        _node(s, "n1", "site", DAY0 + timedelta(hours=15), [0, 0, 0, 0], [100.0] * 4)
    # 15:00-16:00 has no price: filled with the mean of 14:00 (100) and 16:00 (300) = 200
    jid = onprem_job(any_store, "site", "n1", [0], DAY0 + timedelta(hours=15))
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, jid), repo.attempt_row(s, jid, 1), DAY0 + timedelta(hours=15), "r")
        _node(s, "n1", "site", DAY0 + timedelta(hours=16), [360_000_000, 0, 0, 0], [100.0] * 4)
    run_ranks(any_store, jid, 1, DAY0 + timedelta(hours=15), [(0, 0, DAY0 + timedelta(hours=16))], cloud=False)
    _, energy = sorted(records(any_store, jid), key=lambda r: r.line)
    # 100 W x 1 h x 1.2 = 0.12 kWh at 200 USD/MWh = 0.024 USD
    assert energy.billed_usd == pytest.approx(0.024)
    assert energy.estimated and energy.estimate_reasons == (
        "electricity price interpolated for 2024-03-05T15:00Z in SITE",)
    # 20:00-30:00 has no price within 3 h of 24:00: unknown, said so, not 0
    v, why = ledger.window_integral(gap, (DAY0 + timedelta(hours=24)).timestamp(),
                                    (DAY0 + timedelta(hours=25)).timestamp(), "electricity price")
    assert v is None and why == ["no electricity price for 2024-03-06T00:00Z in SITE (no value within 3 h)"]
    assert ledger.window_integral(None, 0, 1, "electricity price") == (None, ["no electricity price series"])


def test_a_rank_that_never_reported_is_metered_to_the_attempts_end_and_flagged(any_store):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0, nodes=2)
    with any_store.session() as s:
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
        assert lifecycle.mark_running(s, j, att, t0 + timedelta(seconds=30), "running")
    with any_store.session() as s:  # rank 1's instance is gone without a word: the watch requeues the gang
        j = s.get(Job, jid)
        assert lifecycle.requeue_lost(s, j, t0 + timedelta(seconds=600), "instance gone", max_attempts=5)
    rs = records(any_store, jid)
    assert [r.run_s for r in rs] == [600.0, 600.0]
    assert all("never reported its end" in " ".join(r.estimate_reasons) for r in rs)


# ----------------------------------------------------------------------------- faults

def test_a_crash_while_writing_usage_leaves_no_half_record(any_store, monkeypatch):
    t0 = DAY0 + timedelta(hours=10, minutes=50)
    jid = cloud_job(any_store, GCP_SPOT, t0, nodes=2)
    real = usage.add_usage

    def crash_after_one(s, records, now):
        real(s, list(records)[:1], now)
        s.flush()
        raise RuntimeError("broker killed while writing usage")

    monkeypatch.setattr(usage, "add_usage", crash_after_one)
    with pytest.raises(RuntimeError, match="broker killed"):
        run_ranks(any_store, jid, 1, t0, [(1, 0, t0 + timedelta(minutes=30)), (0, 0, t0 + timedelta(minutes=30))])
    # the rank-1 end was its own transaction and stays; the attempt's end and its usage rolled back together
    assert records(any_store, jid) == []
    assert any_store.get(jid).state == "running"
    with any_store.session() as s:
        assert repo.attempt_row(s, jid, 1).ended_at is None
    monkeypatch.setattr(usage, "add_usage", real)
    with any_store.session() as s:  # the report is sent again
        j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1, lock=True)
        assert lifecycle.rank_ended(s, j, att, 0, 0, t0 + timedelta(minutes=30), Place.instance("rank 0"),
                                    max_attempts=5).outcome == "succeeded"
    assert [r.rank for r in records(any_store, jid)] == [0, 1]


def test_adding_the_same_records_twice_writes_them_once(any_store):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    run_ranks(any_store, jid, 1, t0, [(0, 0, t0 + timedelta(seconds=45))])
    [r] = records(any_store, jid)
    with any_store.session() as s:
        assert usage.add_usage(s, [r, r], t0) == 0
    assert records(any_store, jid) == [r]


def test_a_usage_record_that_ends_before_it_starts_is_refused_naming_the_fields():
    base = dict(job_id="j", attempt=1, rank=0, line="instance", resource="i-1", team="ml", provider="aws",
                gpu_type="V100", gpu_count=1, run_s=1.0, billed_s=60.0, list_unit_price_usd=1.0, billed_usd=0.01,
                energy_kwh=0.0, carbon_kg=0.0)
    with pytest.raises(UsageError, match=r"end='2024-03-05T00:00:00\+00:00': before start='2024-03-05T00:01:00"):
        UsageRecord(**base, start=DAY0 + timedelta(minutes=1), end=DAY0)
    with pytest.raises(UsageError, match=r"billed_usd=None: an unknown figure needs estimated=True and a reason"):
        UsageRecord(**{**base, "billed_usd": None}, start=DAY0, end=DAY0)
    with pytest.raises(UsageError, match=r"billed_usd=nan: not a finite number"):
        UsageRecord(**{**base, "billed_usd": float("nan")}, start=DAY0, end=DAY0)
    with pytest.raises(UsageError, match=r"pricing_unit='kWh': an instance line is priced per 'Hours'"):
        UsageRecord(**base, pricing_unit="kWh", start=DAY0, end=DAY0)
    with pytest.raises(UsageError, match=r"line='tape': not one of"):
        UsageRecord(**{**base, "line": "tape"}, start=DAY0, end=DAY0)


def test_an_offer_or_pool_missing_from_the_prices_is_flagged_not_zero(any_store):
    install(offers=(), pools=())
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    run_ranks(any_store, jid, 1, t0, [(0, 0, t0 + timedelta(seconds=45))])
    [r] = records(any_store, jid)
    assert (r.billed_usd, r.energy_kwh, r.carbon_kg, r.billed_s) == (None, None, None, 60.0)
    assert r.estimated and "not in the price catalog" in r.estimate_reasons[-1]


# ----------------------------------------------------------------------------- the real report path

def test_replaying_the_same_instance_report_twice_meters_once(pg_store, settings):
    """Through the instance report API on moto EC2: the exited report sent twice (same ``seq``), then again
    with a fresh ``seq`` after the attempt ended, leaves one usage line per instance."""
    offers = tc.OFFERS
    install(offers=offers, carbon={"US-MIDA-PJM": hourly("US-MIDA-PJM", "gCO2e/kWh", {}, 400.0, hours=24 * 3650,
                                                         start=datetime(2020, 1, 1, tzinfo=UTC))})
    cb = tc.CloudBroker(pg_store, settings, offers=offers, computes={"aws": tc.adapter(settings)})
    jid = tc.place(pg_store, tc.spec(nodes=1), offers[0])
    cb.provision(jid, 1)
    api, token = tc._api(pg_store, settings, cb), cb.token(jid, 1, 0)
    assert tc._report(api, token, job_id=jid, attempt=1, rank=0, event="running", seq=1).json() == {"outcome": "running"}
    exited = dict(job_id=jid, attempt=1, rank=0, event="exited", exit_code=0, seq=2)
    assert tc._report(api, token, **exited).json() == {"outcome": "succeeded"}
    assert tc._report(api, token, **exited).json() == {"outcome": "duplicate"}
    assert tc._report(api, token, **{**exited, "seq": 3}).status_code == 200  # taken, the attempt has ended
    rs = records(pg_store, jid)
    [r] = [x for x in rs if x.line == "instance"]
    assert (r.line, r.provider, r.market, r.billed_s >= 60.0, r.list_unit_price_usd) == ("instance", "aws", "spot",
                                                                                      True, 0.9)
    # the teardown deleted the instance: its disk line, and the moments between the attempt's end and the
    # deletion as an idle line; each once
    assert sorted(x.line for x in rs) in (["disk", "instance"], ["disk", "idle", "instance"])
    with pg_store.session() as s:
        assert s.scalar(select(func.count()).select_from(UsageRow)) == len(rs)


def test_the_ledger_outlives_the_retention_purge_of_its_job(any_store):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(any_store, AWS_OD, t0)
    run_ranks(any_store, jid, 1, t0, [(0, 0, t0 + timedelta(seconds=45))])
    with any_store.session() as s:
        s.execute(update(Job).where(Job.id == jid).values(finished_at=t0))
    with any_store.session() as s:
        gone = repo.purge_finished(s, ["succeeded"], t0 + timedelta(days=1), 10, ["intent"])
    assert gone["jobs"] == 1
    with pytest.raises(JobNotFound):
        any_store.get(jid)
    assert [r.job_id for r in records(any_store, jid)] == [jid]  # finance keeps the record


def test_an_onprem_attempt_through_the_node_api_is_metered_from_the_agents_energy_counters(pg_store):
    """The node agent's path: heartbeats carrying NVML counters, ``running``, a later heartbeat, ``ended``: the
    energy line comes from the counters (not flagged), priced with the live broker's own prices (the bundled
    cluster's pool ``local``, replayed tariff and carbon)."""
    import time

    from fastapi.testclient import TestClient

    from broker.service.api import create_app
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.settings import BrokerSettings
    from broker.service.tokens import create_node_token

    ledger.install(None)  # the process's own prices, as the live broker has them,
    ledger.prices()  # built before the run is timed (~1-2 s: the live wiring builds them at start-up)
    settings = BrokerSettings(admin_token="admin-secret-for-tests", max_attempts=3)
    c = TestClient(create_app(pg_store, settings))
    tok = {"Authorization": f"Bearer {create_node_token(pg_store, 'n2')}"}

    def heartbeat(mj: int) -> None:
        tel = {"backend": "fake", "gpus": [{"index": 0, "energy_mj": mj, "power_w": 250.0}]}
        body = {"pool": "local", "gpu_type": "V100", "gpu_count": 1, "gpu_memory_gb": 16.0, "healthy_gpus": [0],
                "agent_id": "a", "telemetry": tel}
        assert c.post("/v1/node/heartbeat", json=body, headers=tok).status_code == 200

    t0 = time.monotonic()
    counter = lambda: 1_000_000 + round(250 * (time.monotonic() - t0) * 1000)  # noqa: E731  250 W, in mJ
    heartbeat(counter())
    jid = pg_store.submit("ml", JobSpec(command=["true"], estimated_duration_s=60.0))[0].id
    PlanningCycle(pg_store, LiveEnvironment(settings.planner), settings).run()
    heartbeat(counter())  # the agent's next heartbeat, just before it starts the job
    base = f"/v1/node/attempts/{jid}/1/0"
    assert c.post(f"{base}/running", headers=tok).json() == {"changed": True}
    t = time.monotonic()
    time.sleep(1.5)
    heartbeat(counter())
    assert c.post(f"{base}/ended", json={"exit_code": 0}, headers=tok).json()["recorded"] is True
    elapsed = time.monotonic() - t
    amortised, energy = sorted(records(pg_store, jid), key=lambda r: r.line)
    assert (energy.pool, energy.gpu_count, energy.resource) == ("local", 1, "n2")
    # 250 W x the run (~1.5 s) x PUE 1.3 (broker/data/local_cluster.yaml)
    assert energy.energy_kwh == pytest.approx(0.250 * 1.3 * energy.run_s / 3600, rel=0.05)
    assert energy.run_s == pytest.approx(elapsed, abs=0.5)
    assert not energy.estimated, energy.estimate_reasons
    assert energy.billed_usd is not None and energy.carbon_kg is not None and energy.carbon_kg > 0
    assert amortised.billed_usd == pytest.approx(0.55 * energy.run_s / 3600)  # $0.55/GPU-h


def test_counter_readings_far_from_the_runs_edges_give_the_mean_power_over_the_run_flagged(any_store):
    t_read, t0, t1 = (DAY0 + timedelta(hours=14), DAY0 + timedelta(hours=14, minutes=30),
                      DAY0 + timedelta(hours=15, minutes=30))
    with any_store.session() as s:  # the last heartbeat before the start was 30 min earlier
        _node(s, "n1", "site", t_read, [0, 0, 0, 0], [200.0] * 4)
    jid = onprem_job(any_store, "site", "n1", [0], t0)
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, jid), repo.attempt_row(s, jid, 1), t0, "running")
        _node(s, "n1", "site", t1, [1_080_000_000, 0, 0, 0], [200.0] * 4)  # 1080 kJ over 5400 s: 200 W
    run_ranks(any_store, jid, 1, t0, [(0, 0, t1)], cloud=False)
    _, energy = sorted(records(any_store, jid), key=lambda r: r.line)
    # 200 W x 1 h x PUE 1.2 = 0.24 kWh (not the 0.36 kWh the counter moved since the earlier reading);
    # tariff 30 min at 100 + 30 min at 300 USD/MWh: 0.24 kW x 200 / 1000 = 0.048 USD
    assert energy.energy_kwh == pytest.approx(0.24) and energy.billed_usd == pytest.approx(0.048)
    assert energy.estimated and energy.estimate_reasons == (
        "GPU 0: counter read over 5400 s of the 3600-s run; scaled to the run",)


# ----------------------------------------------------------------------------- attempts on a Slurm pool
def _slurm_attempt(meter: dict | None, gpus: int = 2, pool: str = "site"):
    from types import SimpleNamespace

    start = DAY0 + timedelta(hours=2)
    return SimpleNamespace(kind="slurm", job_id="job-00000000000000aa", number=1, pool=pool, gpu_type="V100",
                           gpus=gpus, external_id="4242", started_at=start, ended_at=start + timedelta(seconds=3700),
                           meter={"scheduler": meter} if meter is not None else None, rank_exits={}, nodes=[])


def test_slurm_attempt_metered_from_the_clusters_elapsed_and_consumed_energy():
    from types import SimpleNamespace

    att = _slurm_attempt({"job_id": "4242", "elapsed_s": 3600.0, "consumed_energy_j": 3.6e6})
    amort, energy = sorted(ledger.meter_attempt(None, att, SimpleNamespace(team="vision", spec={}), att.ended_at,
                                                ledger.prices()), key=lambda r: r.line)
    # 3.6 MJ over Slurm's 3600 s: 1 kW of IT power x PUE 1.2 = 1.2 kWh at 50 USD/MWh and 100 gCO2e/kWh
    assert (energy.line, energy.resource, energy.provider, energy.pool, energy.run_s, energy.gpu_count) == (
        "energy", "slurm:4242", "onprem", "site", 3600.0, 2)
    assert energy.energy_kwh == pytest.approx(1.2)
    assert energy.billed_usd == pytest.approx(0.06)
    assert energy.carbon_kg == pytest.approx(0.12)
    assert (energy.estimated, energy.estimate_reasons) == (False, ())
    # 2 GPUs x 1 h x 0.5 USD/GPU-h
    assert (amort.line, amort.billed_usd, amort.energy_kwh, amort.estimated) == ("amortised", pytest.approx(1.0), 0.0,
                                                                                 False)


def test_slurm_attempt_without_accounting_is_modelled_and_flagged():
    from types import SimpleNamespace

    from pricing.power import gpu_power_w

    att = _slurm_attempt({"job_id": "4242", "elapsed_s": None, "consumed_energy_j": None}, gpus=1)
    amort, energy = sorted(ledger.meter_attempt(None, att, SimpleNamespace(team="vision", spec={}), att.ended_at,
                                                ledger.prices()), key=lambda r: r.line)
    kwh = gpu_power_w("V100") / 1000 * 1.2 * 3700 / 3600  # the attempt's own 3700 s, modelled V100 power x PUE
    assert energy.run_s == 3700.0 and energy.energy_kwh == pytest.approx(kwh)
    assert energy.estimate_reasons == (
        "no elapsed time from the scheduler; metered from the attempt's start to its end",
        "the scheduler accounted no energy (ConsumedEnergy); modelled 1 x V100 power")
    assert amort.estimated and amort.billed_usd == pytest.approx(3700 / 3600 * 0.5)
    unknown = _slurm_attempt({"elapsed_s": 10.0}, pool="nowhere")
    lines = ledger.meter_attempt(None, unknown, SimpleNamespace(team="v", spec={}), unknown.ended_at, ledger.prices())
    assert [(r.line, r.billed_usd, r.energy_kwh) for r in lines] == [("energy", None, None), ("amortised", None, 0.0)]
    assert "pool 'nowhere' not in the cluster file" in lines[0].estimate_reasons[-1]


def test_savings_rates_of_a_gpu_type_without_a_power_figure_leave_its_work_out_not_fail():
    """An energy line of unknown cost on a GPU type the power table does not know ("X9", in a pool): no on-prem
    rate for X9 (its work is counted as not compared; this was a 500 for every team), and V100 is still priced
    from its modelled power: 0.5 amortised + W/1000 x PUE 1.2 x the site's mean tariff over hours 14-16 of
    DAY0 ((100 + 300) / 2 = 200 USD/MWh, per kWh / 1000)."""
    from broker.usage import savings
    from pricing.power import gpu_power_w

    x9 = Pool(name="x9lab", carbon_zone="SITE", price_zone="SITE", pue=1.2, amortised_usd_per_gpu_hour=0.4,
              nodes=(PoolNode(name="x9-1", gpu_type="X9", gpu_count=2),))
    install(pools=(POOL, x9))
    base = dict(attempt=1, rank=0, line="energy", pricing_unit="kWh", resource="n", team="ml", provider="onprem",
                gpu_count=1,
                run_s=3600.0, billed_s=3600.0, list_unit_price_usd=None, billed_usd=None, energy_kwh=None,
                carbon_kg=None, estimated=True, estimate_reasons=("no power reading",),
                start=DAY0 + timedelta(hours=14), end=DAY0 + timedelta(hours=15))
    recs = [UsageRecord(**base, job_id="j", gpu_type="X9"), UsageRecord(**base, job_id="k", gpu_type="V100")]
    cloud, onprem, notes = ledger.counterfactual_rates(ledger.prices(), recs, DAY0 + timedelta(hours=14),
                                                      DAY0 + timedelta(hours=16))
    assert "X9" not in onprem and "X9 on-prem: no energy line and no power figure for this GPU type" in notes
    assert onprem == {"V100": pytest.approx(0.5 + gpu_power_w("V100") / 1000 * 1.2 * 200 / 1000)}
    assert savings(recs, cloud, onprem).not_compared_units == 2  # both lines' cost is unknown


def test_savings_rates_find_a_live_gpu_type_the_cluster_file_does_not_list():
    """An A100 job ran on GCP; pool "site" (its file says V100) has a registered A100 node. cb5ea98: "A100 on-prem:
    no pool has this type" and the work left out. Now site prices it: 0.5 amortised + modelled A100 power x PUE 1.2
    x the site's mean tariff over hours 14-16 of DAY0 ((100 + 300) / 2 = 200 USD/MWh)."""
    from pricing.power import gpu_power_w

    install()
    rec = UsageRecord(job_id="j", attempt=1, rank=0, line="instance", resource="i-1", team="ml", provider="gcp",
                      start=DAY0 + timedelta(hours=14), end=DAY0 + timedelta(hours=15), gpu_type="A100", gpu_count=1,
                      run_s=3600.0, billed_s=3600.0, list_unit_price_usd=1.2, billed_usd=1.2, energy_kwh=0.4,
                      carbon_kg=0.2, region="us-central1", instance_type="a2-highgpu-1g", market="spot")
    window = (DAY0 + timedelta(hours=14), DAY0 + timedelta(hours=16))
    _cloud, onprem, notes = ledger.counterfactual_rates(ledger.prices(), [rec], *window)
    assert "A100" not in onprem and any(n.startswith("A100 on-prem: no pool of the cluster file") for n in notes)
    _cloud, onprem, notes = ledger.counterfactual_rates(ledger.prices(), [rec], *window, live_nodes=[("site", "A100")])
    assert onprem == {"A100": pytest.approx(0.5 + gpu_power_w("A100") / 1000 * 1.2 * 200 / 1000)}
    assert [n.split(" = ")[1][:23] for n in notes if n.startswith("A100 on-prem")] == ["pool site amortised 0.5"]
