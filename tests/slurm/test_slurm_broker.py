"""A Slurm pool of the live broker (issue #14): the planning cycle places jobs on a real local Slurm 22.05
(tests/slurm/cluster.py), the reconciler's watch follows them, all on a real PostgreSQL store."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from broker.model import JobSpec
from broker.service import ledger
from broker.service.cycle import PlanningCycle
from broker.service.live import LiveEnvironment
from broker.service.reconciler import Reconciler
from broker.service.schedulers import SchedulerPools
from broker.service.settings import BrokerSettings
from broker.service.store import usage as usage_rows
from broker.service.store.core import JobStore
from pricing.power import gpu_power_w, gpu_spec
from providers.slurm import SlurmJobRequest
from tests.conftest import PG_URL

BROKER_ID = "b-live"
#: the unprivileged account the broker submits as (the local cluster runs as root)
ACCOUNT = "nobody"


@pytest.fixture(scope="module", params=["cli", "rest"])
def cluster_file(request, slurm_cluster, tmp_path_factory):
    """A cluster file with one Slurm pool ``hpc`` (the local cluster) in Ontario: on the CLI path, then on the
    slurmrestd (REST + JWT) path: every test runs on both."""
    d = tmp_path_factory.mktemp("cluster")
    f = d / "cluster.json"
    jwt = slurm_cluster.token(path=slurm_cluster.root / "etc" / "nobody.jwt", user=ACCOUNT)
    rest = dict(rest_url=slurm_cluster.rest_url, jwt_file=str(jwt), rest_user=ACCOUNT)
    f.write_text(json.dumps({"pools": [{
        "name": "hpc", "kind": "slurm", "site": "local Slurm", "carbon_zone": "CA-ON", "price_zone": "CA-ON",
        "pue": 1.2, "amortised_usd_per_gpu_hour": 0.4,
        "slurm": {"partition": "gpu", "broker_id": BROKER_ID, "log_dir": str(logs_of(slurm_cluster, request.param)),
                  "checkpoint_root": str(slurm_cluster.root / f"broker-ckpt-{request.param}"),
                  "slurm_conf": str(slurm_cluster.conf), "term_grace_s": 1.0,
                  **(rest if request.param == "rest" else {"submit_user": ACCOUNT})}}]}))
    return f


def logs_of(slurm_cluster, path: str) -> Path:
    """The pool's ``log_dir`` on the ``cli`` or ``rest`` path (made by the adapter, owned by ``nobody``)."""
    return slurm_cluster.root / f"broker-logs-{path}"


@pytest.fixture(scope="module")
def env(cluster_file):
    """The planning environment of the cluster file; the ledger prices with it (as the live wiring installs)."""
    e = LiveEnvironment(BrokerSettings().planner, cluster_file)
    ledger.install(ledger.LedgerPrices.from_environment(e))
    yield e
    ledger.install(None)


@pytest.fixture
def broker(env, cluster_file):
    """``(store, cycle, reconciler, pools)`` on a fresh PostgreSQL schema; every job of this broker left in the
    cluster is cancelled afterwards."""
    store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    st = BrokerSettings(cluster=cluster_file, max_attempts=3)
    pools = SchedulerPools(env.site_pools.values(), st)
    cycle = PlanningCycle(store, env, st, dispatch=lambda j, a: None, schedulers=pools)
    rec = Reconciler(store, st, schedulers=pools)
    yield store, cycle, rec, pools
    ad = pools.adapter("hpc")
    for info in ad.list_managed():
        ad.cancel(info.slurm_job_id, grace_s=0)
    store.drop_schema()


def _spec(command: str, **kw) -> JobSpec:
    kw.setdefault("estimated_duration_s", 60.0)
    kw.setdefault("gpu_types", ["A100"])
    return JobSpec(command=["bash", "-c", command], **kw)


def _until(store, rec, job_id, states, timeout_s=40.0):
    """Reconciler passes until the job is in one of ``states``; returns the job."""
    end = time.monotonic() + timeout_s
    while True:
        rec.run()
        j = store.get(job_id)
        if j.state in states or time.monotonic() > end:
            return j
        time.sleep(0.2)


def _ext(store, job_id, attempt=1):
    [a] = [a for a in store.attempts(job_id) if a.number == attempt]
    return a.external_id


def _row(store, job_id, attempt=1) -> dict:
    """The attempt's stored ``meter`` and ``rank_exits``."""
    with store.session() as s:
        a = JobStore.attempt_row(s, job_id, attempt)
        return {"meter": a.meter, "rank_exits": a.rank_exits}


def test_one_gpu_job_placed_by_the_planner_runs_to_succeeded_with_its_log_and_usage(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec('sleep 2; echo "rank=$NODE_RANK nnodes=$NNODES world=$WORLD_SIZE '
                                          'attempt=$FEDBROKER_ATTEMPT"'))
    res = cycle.run()
    assert res.kinds == {"start": 1}
    [(key, what)] = res.submitted.items()
    assert key == (job.id, 1) and what.startswith("submitted ")
    sid = what.split()[1]
    assert _ext(store, job.id) == sid
    j = store.get(job.id)
    assert (j.state, j.placement["kind"], j.placement["pool"], j.placement["scheduler_gpu_type"]) == (
        "starting", "slurm", "hpc", "a100")
    from broker.cli.jobs import placement_text  # what `fedbroker status` prints (a raw dict on cb5ea98)

    [part] = j.placement["nodes"]
    assert placement_text(j.placement) == (f"Slurm pool hpc (A100): {part['node']}[{part['gpus'][0]}]; "
                                           "scheduler gpu type a100")
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    assert (done.state, done.exit_code, done.reason) == ("succeeded", 0, "exit code 0")
    path = "rest" if pools.adapter("hpc").settings.rest_url else "cli"
    assert Path(logs_of(slurm_cluster, path) / f"fedbroker-{sid}.out").read_text() == (
        "rank=0 nnodes=1 world=1 attempt=1\n")
    assert store.log_chunks(job.id, 1) == [(0, "rank=0 nnodes=1 world=1 attempt=1\n")]  # fedbroker logs
    [att] = store.attempts(job.id)
    assert (att.kind, att.outcome, att.exit_code, att.pool, att.gpu_type, att.gpus) == (
        "slurm", "succeeded", 0, "hpc", "A100", 1)
    meter = _row(store, job.id)["meter"]["scheduler"]
    assert meter["job_id"] == sid and meter["consumed_energy_j"] is None
    with store.session() as s:
        recs = usage_rows.usage_rows(s, job.id)
    assert [(r.line, r.resource, r.provider, r.pool, r.gpu_count) for r in recs] == [
        ("amortised", f"slurm:{sid}", "onprem", "hpc", 1), ("energy", f"slurm:{sid}", "onprem", "hpc", 1)]
    amort, energy = recs
    run_s = meter["elapsed_s"]
    assert 2.0 <= run_s <= 10.0  # Slurm's RunTime of the job (whole seconds)
    assert amort.run_s == run_s and amort.billed_usd == pytest.approx(1 * run_s / 3600 * 0.4)
    # no accounting in the test cluster: modelled power of one A100 x PUE 1.2, flagged
    assert energy.energy_kwh == pytest.approx(gpu_power_w("A100") / 1000 * 1.2 * run_s / 3600)
    assert energy.estimated and "the scheduler accounted no energy (ConsumedEnergy); modelled 1 x A100 power" in \
        energy.estimate_reasons


def test_two_node_gang_runs_to_succeeded_once_per_node(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec('echo "rank=$NODE_RANK of $NNODES master=$MASTER_ADDR '
                                          'pet=$PET_NODE_RANK/$PET_NNODES"', nodes=2))
    res = cycle.run()
    assert res.kinds == {"start": 1}
    sid = _ext(store, job.id)
    assert len(store.get(job.id).placement["nodes"]) == 2
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("succeeded", 0)
    rank0, rank1 = store.log_chunks(job.id, 1, 0), store.log_chunks(job.id, 1, 1)  # fedbroker logs --rank N
    master = rank0[0][1].split("master=")[1].split()[0]
    assert (rank0, rank1) == ([(0, f"rank=0 of 2 master={master} pet=0/2\n")],
                              [(0, f"rank=1 of 2 master={master} pet=1/2\n")])
    assert master.startswith("a00")
    assert _row(store, job.id)["rank_exits"] == {"0": 0, "1": 0}


def test_failing_job_fails_with_its_exit_code(broker):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec("exit 3"))
    cycle.run()
    sid = _ext(store, job.id)
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    assert (done.state, done.exit_code) == ("failed", 3)
    assert done.reason == f"exited with code 3 (Slurm job {sid} on a001)"


def test_cancel_stops_a_running_job(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec("sleep 60"))
    cycle.run()
    sid = _ext(store, job.id)
    assert _until(store, rec, job.id, {"running"}).state == "running"
    store.request_cancel(job.id)
    done = _until(store, rec, job.id, {"cancelled", "failed", "succeeded"})
    assert (done.state, done.reason) == ("cancelled", "cancelled by user; scancel: SIGTERM, then kill after the grace")
    info = pools.adapter("hpc").describe(sid)
    assert (info.state, info.reason, info.slurm_active) == ("cancelled", "cancelled by the broker", False)
    assert store.attempts(job.id)[0].outcome == "cancelled"


def test_job_killed_by_the_cluster_admin_is_reported_with_the_reason(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec("sleep 60"))
    cycle.run()
    sid = _ext(store, job.id)
    assert _until(store, rec, job.id, {"running"}).state == "running"
    slurm_cluster.run("scancel", sid)
    done = _until(store, rec, job.id, {"failed", "cancelled", "succeeded"})
    assert done.state == "failed"
    assert done.reason.startswith("cancelled in the cluster, not by the broker (scancel by an administrator or the "
                                  "job's owner; signal ")
    assert done.reason.endswith(f"(Slurm job {sid} on a001)")
    assert store.attempts(job.id)[0].outcome == "cancelled"


def test_node_down_mid_run_requeues_the_attempt(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec("sleep 60", gpu_types=["H100"], checkpoint_interval_s=1.0))
    cycle.run()
    sid = _ext(store, job.id)
    assert _until(store, rec, job.id, {"running"}).state == "running"
    time.sleep(1.5)
    slurm_cluster.run("scontrol", "update", "NodeName=h001", "State=DOWN", "Reason=fedbroker-test")
    try:
        done = _until(store, rec, job.id, {"queued", "failed", "succeeded"})
    finally:
        slurm_cluster.run("scontrol", "update", "NodeName=h001", "State=RESUME", check=False)
    assert done.state == "queued" and done.attempt == 1
    [att] = store.attempts(job.id)
    assert att.outcome == "interrupted"
    if pools.adapter("hpc").settings.rest_url:  # slurmrestd v0.0.38 ignores requeue=false: Slurm requeued it
        assert att.reason.startswith(f"Slurm job {sid} on "), att.reason
        assert "Slurm requeued the job itself (restart 1, " in att.reason
    else:
        assert att.reason == (f"Slurm job {sid} on h001: NODE_FAIL on h001 (Slurm reason NodeDown): the broker "
                              "requeues the attempt")
    with store.session() as s:
        assert JobStore.job_row(s, job.id).work_done_s >= 1.0  # checkpointed work kept (1-s checkpoints)
    assert pools.adapter("hpc").describe(sid).slurm_active is False


def test_forgotten_job_is_swept(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    ad = pools.adapter("hpc")
    # what a broker that crashed after sbatch leaves: a job with our tags and no attempt in the store
    info = ad.submit(SlurmJobRequest(job_id="job-00000000deadbeef", attempt=1, team="vision", command="sleep 60",
                                     gpu_type="a100", gpus_per_node=1, estimate_s=60))
    other = slurm_cluster.run("sbatch", "--parsable", "-p", "gpu", "-t", "5", "-o", "/dev/null",
                              "--gpus-per-node=a100:1", "--wrap", "sleep 60").stdout.strip()  # not ours: never touched
    try:
        out = rec.run()["schedulers"]
        assert out["swept"] == 1
        assert ad.describe(info.slurm_job_id).state == "cancelled"
        assert ad.describe(info.slurm_job_id).reason == "cancelled by the broker"
        assert slurm_cluster.run("squeue", "-h", "-j", other, "-o", "%T").stdout.strip() in ("PENDING", "RUNNING")
    finally:
        slurm_cluster.run("scancel", other, check=False)


def test_capacity_matches_sinfo_and_the_explain_record_shows_the_pool_beside_the_cloud(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    [row] = pools.status()
    sinfo = slurm_cluster.run("sinfo", "-h", "-N", "-p", "gpu", "-O", "NodeList:|,StateLong:|,Gres:|").stdout
    total: dict[str, int] = {}
    for line in sinfo.splitlines():
        node, state, gres = line.split("|")[:3]
        typ, n = gres.strip().split(":")[1:3]
        total[typ] = total.get(typ, 0) + int(n)
    assert total == {"a100": 6, "h100": 4}
    assert row == {"name": "hpc", "kind": "slurm", "health": "reachable", "free_gpus": {"a100": 6, "h100": 4},
                   "total_gpus": {"a100": 6, "h100": 4}, "nodes": 4, "backlog_gpus": 0}
    view = pools.read()["hpc"]
    assert [(n.name, n.gpu_type, n.gpu_count, n.healthy) for n in view.nodes] == [
        ("hpc/a001", "A100", 2, (0, 1)), ("hpc/a002", "A100", 2, (0, 1)), ("hpc/a003", "A100", 2, (0, 1)),
        ("hpc/h001", "H100", 4, (0, 1, 2, 3))]
    job, _ = store.submit("vision", _spec("true", estimated_duration_s=3600.0))
    cycle.run()
    rec_ = store.decision(job.id)
    opt = rec_["option"]
    runtime = 3600.0 / gpu_spec("A100").rel_throughput
    kwh = gpu_power_w("A100") / 1000 * 1.2 * runtime / 3600
    assert (opt["kind"], opt["target"], opt["wait_s"]) == ("onprem", "hpc", 0.0)
    assert opt["runtime_s"] == pytest.approx(runtime)
    assert opt["energy_kwh"] == pytest.approx(kwh)
    assert opt["dollars_usd"] > runtime / 3600 * 0.4  # amortised $ plus the electricity
    assert opt["carbon_kg"] > 0
    clouds = [a for a in rec_["alternatives"] if a["kind"] == "cloud"]
    assert clouds and all(a["dollars_usd"] > 0 and a["energy_kwh"] > 0 and a["carbon_kg"] is not None
                          and a["wait_s"] >= 0 for a in clouds)


def test_fedbroker_pools_lists_kind_health_and_free_gpus(slurm_cluster, cluster_file, tmp_path):
    from typer.testing import CliRunner

    from broker.cli.main import app

    pools = json.loads(cluster_file.read_text())["pools"]
    down = {**pools[0], "name": "gone", "slurm": {"partition": "gpu", "slurm_conf": str(tmp_path / "none.conf"),
                                                  "timeout_s": 5, "submit_user": ACCOUNT}}  # no cluster config
    agent = {"name": "local", "carbon_zone": "CA-ON", "price_zone": "CA-ON",
             "nodes": [{"name": "n1", "gpu_type": "V100", "gpu_count": 4}]}
    cf = tmp_path / "cluster.json"
    cf.write_text(json.dumps({"pools": [pools[0], down, agent]}))
    cfg = tmp_path / "settings.yaml"
    cfg.write_text(f"database_url: sqlite:///{tmp_path / 'fb.db'}\ncluster: {cf}\n")
    r = CliRunner().invoke(app, ["pools", "--config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    hpc, gone, local = json.loads(r.stdout[r.stdout.index("["):])
    assert hpc == {"name": "hpc", "kind": "slurm", "health": "reachable", "free_gpus": {"a100": 6, "h100": 4},
                   "total_gpus": {"a100": 6, "h100": 4}, "nodes": 4, "backlog_gpus": 0}
    assert (gone["kind"], gone["free_gpus"], gone["nodes"]) == ("slurm", {}, 0)
    assert gone["health"].startswith("SchedulerUnavailable: sinfo: "), gone["health"]
    assert local == {"name": "local", "kind": "agent", "health": "no node", "free_gpus": {}, "total_gpus": {},
                     "nodes": 0}
    table = CliRunner().invoke(app, ["pools", "--config", str(cfg)])
    assert table.exit_code == 0 and "6 a100, 4 h100" in table.stdout and "reachable" in table.stdout


def test_the_planner_waits_for_the_cluster_s_running_jobs_and_counts_its_queue_ahead(broker, slurm_cluster):
    store, cycle, rec, pools = broker
    t0 = time.time()
    # another user's job holds all 4 H100 of h001 for its 5-min time limit
    held = slurm_cluster.run("sbatch", "--parsable", "-p", "gpu", "-t", "5", "-o", "/dev/null",
                             "--gpus-per-node=h100:4", "--wrap", "sleep 300").stdout.strip()
    try:
        end = time.monotonic() + 20
        while slurm_cluster.run("squeue", "-h", "-j", held, "-o", "%T").stdout.strip() != "RUNNING":
            assert time.monotonic() < end
            time.sleep(0.2)
        view = pools.read()["hpc"]
        assert [n.healthy for n in view.nodes if n.gpu_type == "H100"] == [()]
        [(end_s, typ, gpus)] = view.releases
        assert (typ, gpus) == ("H100", 4) and abs(end_s - (t0 + 300)) <= 5
        job, _ = store.submit("vision", _spec("true", gpu_types=["H100"], gpus_per_node=4, deferrable=False))
        cycle.run()
        opt = store.decision(job.id)["option"]
        assert (store.get(job.id).state, opt["target"]) == ("queued", "hpc")
        assert abs(opt["start_s"] - end_s) <= 3  # it starts when the running job's time limit frees the GPUs
        # the cluster's own queue: a pending 60-min job for the same 4 GPUs competes for the pool
        slurm_cluster.run("sbatch", "-p", "gpu", "-t", "60", "-o", "/dev/null", "--gpus-per-node=h100:4",
                          "--wrap", "sleep 600")
        view = pools.read()["hpc"]
        assert (view.backlog_gpus, view.backlog_gpu_s) == (4.0, 4 * 3600.0)
        later, _ = store.submit("vision", _spec("true", gpu_types=["H100"], gpus_per_node=4, deferrable=False,
                                                estimated_duration_s=7200.0))  # too long to backfill
        cycle.run()
        opt2 = store.decision(later.id)["option"]
        # the queue ahead (the first job's 4 x 60 GPU-s, the cluster's 4 x 3600) spread over the pool's 10 GPUs
        assert opt2["target"] == "hpc" and opt2["wait_s"] == pytest.approx((4 * 60 + 4 * 3600) / 10, abs=3), opt2
    finally:
        slurm_cluster.run("scancel", "--user=root", "--partition=gpu", check=False)


def test_job_left_pending_in_the_cluster_past_the_start_deadline_is_cancelled_there_and_requeued(broker, slurm_cluster):
    from datetime import timedelta

    from broker.service.store.tables import utcnow

    store, cycle, rec, pools = broker
    # the partition is down: sinfo still shows idle nodes (the planner places the job), Slurm keeps it PENDING
    slurm_cluster.run("scontrol", "update", "PartitionName=gpu", "State=DOWN")
    try:
        job, _ = store.submit("vision", _spec("true"))
        cycle.run()
        sid = _ext(store, job.id)
        info = pools.adapter("hpc").describe(sid)
        assert (info.state, info.slurm_state) == ("starting", "PENDING")
        assert rec.run()["schedulers"]["changed"] == 0  # within starting_deadline_s (120 s): left alone
        out = rec.run(now=utcnow() + timedelta(seconds=121))["schedulers"]
        assert (out["requeued"], out["changed"]) == (1, 1)
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=gpu", "State=UP")
    j = store.get(job.id)
    assert j.state == "queued"
    assert j.reason == f"Slurm job {sid} still pending in pool hpc after 120 s (cancelled there)"
    assert store.attempts(job.id)[0].outcome == "timed_out"
    assert pools.adapter("hpc").describe(sid).state == "cancelled"


def test_gpus_the_planner_cannot_model_are_left_out_with_the_reason(slurm_cluster, tmp_path):
    """A GRES type with no power/throughput model and a node with more GPUs than a pool node holds are left out of
    planning (named), the other nodes are planned; on a second local cluster of that shape."""
    from broker.model import Pool
    from tests.slurm.cluster import LocalSlurm, NodeGroup

    odd = LocalSlurm(groups=(NodeGroup("a", 1, "a100", 2), NodeGroup("q", 1, "qpu", 2), NodeGroup("b", 1, "a100", 17)),
                     rest=False).start()
    try:
        pool = Pool(name="odd", kind="slurm", carbon_zone="CA-ON", price_zone="CA-ON", nodes=(),
                    scheduler={"partition": "gpu", "slurm_conf": str(odd.conf), "submit_user": ACCOUNT})
        view = SchedulerPools([pool], BrokerSettings()).read()["odd"]
    finally:
        odd.cleanup()
    assert view.error is None
    assert [(n.name, n.gpu_type, n.gpu_count) for n in view.nodes] == [("odd/a001", "A100", 2)]
    assert view.skipped == ["b001: 17 x a100 (a pool node holds at most 16 GPUs)",
                            "GPU type 'qpu': no power or throughput model (pricing.power; map it to one in the "
                            "pool's gres_types, e.g. {gpu: A100})"]


def test_a_member_s_job_sees_none_of_the_broker_s_environment(broker, monkeypatch):
    """Issue #20 finding 1, as it was found: the worker holds cloud keys and FEDBROKER_* settings in its
    environment; a member's job on the Slurm pool prints its uid and environment."""
    store, cycle, rec, pools = broker
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "FAKE-worker-key")
    monkeypatch.setenv("FEDBROKER_REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0")
    job, _ = store.submit("evil", _spec("id -u; env"))
    cycle.run()
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    [(_, text)] = store.log_chunks(job.id, 1)
    uid, *env = text.splitlines()
    assert (done.state, uid) == ("succeeded", "65534")
    assert "FAKE-worker-key" not in text and "hunter2" not in text
    assert sorted(v.split("=", 1)[0] for v in env if v.startswith("FEDBROKER_")) == [
        "FEDBROKER_ATTEMPT", "FEDBROKER_JOB_ID", "FEDBROKER_RANK"]  # the launch variables, nothing of the broker's


def test_job_placed_by_the_planner_gets_its_checkpoint_dir_under_the_pool_s_root(broker, slurm_cluster):
    """Issue #20: CHECKPOINT_DIR is <checkpoint_root>/<team>/<job>, made by the job's user; a checkpoint written
    there is kept."""
    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec('touch "$CHECKPOINT_DIR/step1" && echo "ckpt=$CHECKPOINT_DIR uid=$(id -u)"'))
    cycle.run()
    done = _until(store, rec, job.id, {"succeeded", "failed"})
    root = Path(pools.adapter("hpc").settings.checkpoint_root)
    assert (done.state, done.exit_code) == ("succeeded", 0)
    assert store.log_chunks(job.id, 1) == [(0, f"ckpt={root}/vision/{job.id} uid=65534\n")]
    assert (root / "vision" / job.id / "step1").stat().st_uid == 65534


def test_retention_removes_output_files_past_retention_days(broker, slurm_cluster):
    from datetime import timedelta

    from broker.service.store.tables import utcnow

    store, cycle, rec, pools = broker
    job, _ = store.submit("vision", _spec("echo kept"))
    cycle.run()
    sid = _ext(store, job.id)
    assert _until(store, rec, job.id, {"succeeded", "failed"}).state == "succeeded"
    out = Path(pools.adapter("hpc").settings.log_dir) / f"fedbroker-{sid}.out"
    assert out.read_text() == "kept\n" and store.log_chunks(job.id, 1) == [(0, "kept\n")]
    pools._logs_purged_at.clear()
    assert pools.purge_logs("hpc", utcnow()) == 0 and out.exists()  # younger than retention_days (30)
    pools._logs_purged_at.clear()
    assert pools.purge_logs("hpc", utcnow() + timedelta(days=31)) >= 1
    assert not out.exists()
    assert pools.purge_logs("hpc", utcnow() + timedelta(days=32)) == 0  # at most once an hour


def _untyped_cluster_file(odd, tmp_path, **slurm) -> Path:
    f = tmp_path / "untyped.json"
    f.write_text(json.dumps({"pools": [{
        "name": "plain", "kind": "slurm", "carbon_zone": "CA-ON", "price_zone": "CA-ON", "pue": 1.2,
        "amortised_usd_per_gpu_hour": 0.4,
        "slurm": {"partition": "gpu", "broker_id": "b-untyped", "slurm_conf": str(odd.conf), "submit_user": ACCOUNT,
                  "log_dir": str(odd.root / "fb-logs"), "checkpoint_root": str(odd.root / "fb-ckpt"), **slurm}}]}))
    return f


def test_untyped_gres_is_reported_once_then_mapped_by_gres_types_and_used(tmp_path, caplog):
    """Issue #20: an untyped ``gpu:2`` GRES is named once (log, ``fedbroker pools``), not every cycle; with
    ``gres_types: {gpu: A100}`` the planner places a job there and Slurm runs it (``--gpus-per-node=1``)."""
    import logging

    from fastapi.testclient import TestClient

    from broker.cluster import load_cluster
    from broker.service.api import create_app
    from broker.service.schedulers import PoolNotes
    from tests.slurm.cluster import LocalSlurm, NodeGroup

    odd = LocalSlurm(groups=(NodeGroup("g", 2, "", 2),), rest=False).start()
    try:
        unmapped = SchedulerPools(load_cluster(_untyped_cluster_file(odd, tmp_path)), BrokerSettings())
        why = ("GPU type 'gpu': no power or throughput model (pricing.power; map it to one in the pool's "
               "gres_types, e.g. {gpu: A100})")
        with caplog.at_level(logging.WARNING, logger="fedbroker.schedulers"):
            views = [unmapped.read()["plain"] for _ in range(3)]  # three planning cycles
        assert [(v.nodes, v.skipped) for v in views] == [([], [why])] * 3
        assert [r.getMessage() for r in caplog.records] == [f"pool plain: GPUs left out of planning: {why}"]
        [row] = unmapped.status()
        assert row == {"name": "plain", "kind": "slurm", "health": "reachable", "free_gpus": {"gpu": 4},
                       "total_gpus": {"gpu": 4}, "nodes": 2, "backlog_gpus": 0, "not_planned": [why]}

        store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
        store.migrate()
        try:
            # /healthz says it too (read in the background: the first answers may come before the reading)
            app = create_app(store, BrokerSettings(), pool_notes=PoolNotes(BrokerSettings(), unmapped.pools.values()))
            client, end = TestClient(app), time.monotonic() + 30
            while "pools" not in (health := client.get("/healthz").json()) and time.monotonic() < end:
                time.sleep(0.1)
            assert health == {"status": "ok", "database": "ok",
                              "pools": {"plain": {"health": "reachable", "not_planned": [why]}}}

            cf = _untyped_cluster_file(odd, tmp_path, gres_types={"gpu": "A100"})
            env = LiveEnvironment(BrokerSettings().planner, cf)
            st = BrokerSettings(cluster=cf, max_attempts=3)
            pools = SchedulerPools(env.site_pools.values(), st)
            view = pools.read()["plain"]
            assert [(n.name, n.gpu_type, n.gpu_count, n.healthy) for n in view.nodes] == [
                ("plain/g001", "A100", 2, (0, 1)), ("plain/g002", "A100", 2, (0, 1))]
            assert (view.skipped, view.gres) == ([], {"plain/g001": "gpu", "plain/g002": "gpu"})
            assert "not_planned" not in pools.status()[0]
            cycle = PlanningCycle(store, env, st, dispatch=lambda j, a: None, schedulers=pools)
            rec = Reconciler(store, st, schedulers=pools)
            job, _ = store.submit("vision", _spec('echo "gpus=$CUDA_VISIBLE_DEVICES"'))
            assert cycle.run().kinds == {"start": 1}
            pl = store.get(job.id).placement
            assert (pl["kind"], pl["pool"], pl["gpu_type"], pl["scheduler_gpu_type"]) == ("slurm", "plain", "A100",
                                                                                        "gpu")
            done = _until(store, rec, job.id, {"succeeded", "failed"})
            assert (done.state, store.log_chunks(job.id, 1)) == ("succeeded", [(0, "gpus=0\n")])
            sid = _ext(store, job.id)
            tres = odd.run("scontrol", "-o", "show", "job", sid).stdout
            assert "TresPerNode=gres:gpu:1" in tres
        finally:
            store.drop_schema()
    finally:
        odd.cleanup()


def test_a_pool_that_would_run_jobs_as_root_is_left_out_with_the_reason(slurm_cluster, tmp_path):
    """Issue #20: a Slurm pool whose submit account is root (here the broker's own user, the CLI path) is not
    planned (its view carries the refusal) and ``fedbroker pools`` names it as its health."""
    from broker.model import Pool

    pool = Pool(name="asroot", kind="slurm", carbon_zone="CA-ON", price_zone="CA-ON", nodes=(),
                scheduler={"partition": "gpu", "slurm_conf": str(slurm_cluster.conf),
                           "log_dir": str(tmp_path / "logs")})
    pools = SchedulerPools([pool], BrokerSettings())
    view = pools.read()["asroot"]
    why = ("Unsupported: submit_user='root' is root: jobs of other teams would run with its rights; set submit_user "
           "to an unprivileged Slurm account, or allow_privileged_submit: true to accept this")
    assert (view.error, view.nodes) == (why, [])
    assert pools.status()[0] == {"name": "asroot", "kind": "slurm", "health": why, "free_gpus": {}, "total_gpus": {},
                                 "nodes": 0, "backlog_gpus": 0}

    # a log_dir the submit account does not own (its jobs could not write there; others may read it): the same
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    pool = Pool(name="badlogs", kind="slurm", carbon_zone="CA-ON", price_zone="CA-ON", nodes=(),
                scheduler={"partition": "gpu", "slurm_conf": str(slurm_cluster.conf), "submit_user": ACCOUNT,
                           "log_dir": str(shared)})
    pools = SchedulerPools([pool], BrokerSettings())
    why = (f"Unsupported: log_dir='{shared}': owned by uid 0, not by the submit account 'nobody' (uid 65534): make "
           "it mode 0700 owned by that account")
    assert (pools.read()["badlogs"].error, pools.status()[0]["health"]) == (why, why)
