"""providers.kubernetes with the real ``kubernetes`` client against the local fake API server
(tests/providers/fake_k8s.py): containers really run their command here, so exit codes and logs come back
through the pod log endpoint; eviction, node loss, OOM kills, image pulls, 409 and 429 are the fake's."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("kubernetes")

from providers.base import (NoCapacity, PoolJobRequest, ProviderError, QuotaExceeded,  # noqa: E402
                            SchedulerUnavailable, Throttled, Unsupported)
from providers.kubernetes import (FINALIZER, GPU_PRODUCT_LABEL, KUEUE_QUEUE_LABEL, KubernetesPool,  # noqa: E402
                                  KubernetesSettings, job_info, job_name, label_value, settings_from_mapping)
from tests.providers.fake_k8s import FakeK8s  # noqa: E402

A100, H100 = "NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.fixture
def fake():
    with FakeK8s() as f:
        for n in ("a001", "a002", "a003"):
            f.add_node(n, 2, A100)
        f.add_node("h001", 4, H100, taints=[GPU_TAINT])
        f.add_node("c001", 0)  # a CPU node: not part of the pool's capacity
        yield f


@pytest.fixture
def sleeps():
    return []


def make_pool(fake, tmp_path, sleeps=None, **kw):
    kc = fake.kubeconfig(tmp_path / "kubeconfig")
    s = dict(kubeconfig=str(kc), context="fake", broker_id="b-test", gpu_products={"a100": A100, "h100": H100},
             term_grace_s=1.0, priority_class_by_class={"high": "fedbroker-high"})
    s.update(kw)
    return KubernetesPool(KubernetesSettings(**s), sleep=(sleeps.append if sleeps is not None else time.sleep))


@pytest.fixture
def pool(fake, tmp_path, sleeps):
    return make_pool(fake, tmp_path, sleeps)


def req(job_id, command, gpu_type="a100", gpus=1, nodes=1, attempt=0, image="busybox:1.36", **kw):
    return PoolJobRequest(job_id=job_id, attempt=attempt, team="vision", command=command, gpu_type=gpu_type,
                          gpus_per_node=gpus, estimate_s=60, nodes=nodes, image=image, **kw)


def wait(pool, name, states, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while True:
        info = pool.describe(name)
        if info.state in states or time.monotonic() > end:
            return info
        time.sleep(0.05)


def job_body(fake, name):
    return next(b for p, b in fake.bodies if p.endswith("/jobs") and b["metadata"]["name"] == name)


# ---- lifecycle -------------------------------------------------------------------------------------------
def test_one_gpu_job_runs_to_succeeded_with_its_log(pool, fake):
    info = pool.submit(req("one-gpu", 'echo "rank=$NODE_RANK job=$FEDBROKER_JOB_ID master=$MASTER_ADDR $GREETING"',
                           env={"GREETING": "it's me", "NODE_RANK": "7"}, priority_class="high"))
    assert info.pool_job_id == "fb-one-gpu-a0"
    assert info.tags == {"fedbroker-broker": "b-test", "fedbroker-job": "one-gpu", "fedbroker-attempt": "0",
                         "fedbroker-team": "vision"}
    assert info.time_limit_s == 372.0  # ceil(60 * 1.2 + 300)
    done = wait(pool, "fb-one-gpu-a0", {"succeeded", "failed"})
    assert (done.state, done.pool_state, done.exit_code, done.signal, done.reason, done.nodes, done.active) == \
        ("succeeded", "Complete", 0, None, "exited with code 0", "a001", False)
    assert pool.logs("fb-one-gpu-a0") == "rank=0 job=one-gpu master=127.0.0.1 it's me\n"
    body = job_body(fake, "fb-one-gpu-a0")
    pod = body["spec"]["template"]["spec"]
    assert body["metadata"]["finalizers"] == [FINALIZER]
    assert body["metadata"]["labels"] == {"fedbroker-broker": "b-test", "fedbroker-job": "one-gpu",
                                          "fedbroker-attempt": "0", "fedbroker-team": "vision"}
    assert (body["spec"]["backoffLimit"], body["spec"]["activeDeadlineSeconds"], body["spec"]["completionMode"]) == \
        (0, 372, "NonIndexed")
    assert pod["nodeSelector"] == {GPU_PRODUCT_LABEL: A100}
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
    assert pod["containers"][0]["command"][:2] == ["/bin/sh", "-c"]
    assert (pod["priorityClassName"], pod["restartPolicy"], pod["terminationGracePeriodSeconds"]) == \
        ("fedbroker-high", "Never", 1)
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_failing_job_reports_its_exit_code(pool):
    info = pool.submit(req("fails", 'echo "$GREETING"; exit 4', env={"GREETING": "it's me"}))
    done = wait(pool, info.pool_job_id, {"succeeded", "failed"})
    assert (done.state, done.pool_state, done.exit_code, done.reason) == ("failed", "Failed", 4, "exited with code 4")
    assert pool.logs(info.pool_job_id) == "it's me\n"


def test_two_node_gang_runs_once_per_node_with_rank0_as_master(pool, fake):
    info = pool.submit(req("gang", 'echo "rank=$NODE_RANK/$FEDBROKER_RANK master=$MASTER_ADDR:$MASTER_PORT '
                                   'nnodes=$NNODES host=$HOSTNAME"', gpus=2, nodes=2))
    name = "fb-gang-a0"
    done = wait(pool, name, {"succeeded", "failed"})
    assert (done.state, done.exit_code, done.reason, done.nodes) == \
        ("succeeded", 0, "all 2 pods exited with code 0", "a001,a002")
    master = "fb-gang-a0-0.fb-gang-a0.default.svc"
    assert pool.logs(name, rank=0) == f"rank=0/0 master={master}:29500 nnodes=2 host=fb-gang-a0-0\n"
    assert pool.logs(name, rank=1) == f"rank=1/1 master={master}:29500 nnodes=2 host=fb-gang-a0-1\n"
    body = job_body(fake, name)
    assert (body["spec"]["completionMode"], body["spec"]["completions"], body["spec"]["parallelism"]) == \
        ("Indexed", 2, 2)
    assert body["spec"]["template"]["spec"]["subdomain"] == name
    svc = fake.services[("default", name)]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert svc["metadata"]["ownerReferences"][0]["uid"] == fake.jobs[("default", name)]["metadata"]["uid"]
    assert info.pool_job_id == name


def test_gang_is_all_or_nothing_one_failing_rank_stops_the_others(pool, fake):
    pool.submit(req("gang-fail", 'if [ "$NODE_RANK" = 1 ]; then exit 3; fi; sleep 60', nodes=2))
    done = wait(pool, "fb-gang-fail-a0", {"succeeded", "failed"})
    failed = [p for p in fake.pods_of("fb-gang-fail-a0") if p["status"]["phase"] == "Failed"]
    assert (done.state, done.exit_code) == ("failed", 3)
    assert done.reason == f"exited with code 3: pod {failed[0]['metadata']['name']} (rank 1 of 2)"
    end = time.monotonic() + 5
    while pool.describe("fb-gang-fail-a0").active and time.monotonic() < end:
        time.sleep(0.05)
    assert pool.describe("fb-gang-fail-a0").active is False
    assert [p["status"]["phase"] for p in fake.pods_of("fb-gang-fail-a0")] == ["Failed"]  # rank 0 was stopped


def test_capacity_matches_the_nodes_and_require_free(pool, fake):
    caps = {n.node: (n.state, dict(n.gpus_total), dict(n.gpus_used)) for n in pool.capacity()}
    assert caps == {"a001": ("idle", {"a100": 2}, {"a100": 0}), "a002": ("idle", {"a100": 2}, {"a100": 0}),
                    "a003": ("idle", {"a100": 2}, {"a100": 0}), "h001": ("idle", {"h100": 4}, {"h100": 0})}
    assert pool.free_gpus() == {"a100": 6, "h100": 4}
    fake.add_pod("theirs", "a003", 1)  # another team's pod in another namespace
    fake.add_pod("done", "a002", 2, phase="Succeeded")  # finished: holds nothing
    hold = pool.submit(req("hold", "sleep 60", gpu_type="h100", gpus=3))
    assert wait(pool, hold.pool_job_id, {"running"}).state == "running"
    caps = {n.node: n for n in pool.capacity()}
    assert (caps["h001"].state, caps["h001"].gpus_free("h100")) == ("mixed", 1)
    assert (caps["a003"].state, caps["a003"].gpus_free("a100")) == ("mixed", 1)
    assert pool.free_gpus() == {"a100": 5, "h100": 1}
    with pytest.raises(NoCapacity) as e:
        pool.submit(req("wants-two", "true", gpu_type="h100", gpus=2), require_free=True)
    assert (e.value.option, e.value.code) == ("kubernetes:default:h100", "NoCapacity")
    fake.nodes["a001"]["spec"]["unschedulable"] = True  # kubectl cordon
    fake.node_lost("a002")
    states = {n.node: n.state for n in pool.capacity()}
    assert states == {"a001": "drained", "a002": "down", "a003": "mixed", "h001": "mixed"}
    assert pool.free_gpus() == {"a100": 1, "h100": 1}
    pool.cancel(hold.pool_job_id, grace_s=0)


def test_an_untolerated_taint_drains_the_node(fake, tmp_path):
    pool = make_pool(fake, tmp_path, tolerations=[])
    assert {n.node: n.state for n in pool.capacity()}["h001"] == "drained"


def test_gpu_type_or_count_no_node_has_is_unsupported(pool):
    with pytest.raises(Unsupported) as e:
        pool.submit(req("v100", "true", gpu_type="v100"))
    assert (e.value.code, str(e.value)) == ("NoSuchGpuType", "gpu_type='v100' x 1: no node has that "
                                                              "(GPU types: ['a100', 'h100'])")
    with pytest.raises(Unsupported) as e:
        pool.submit(req("big", "true", gpu_type="h100", nodes=2))
    assert (e.value.code, str(e.value)) == ("TooFewNodes", "nodes=2: 1 nodes have 1 x h100")
    with pytest.raises(Unsupported) as e:
        pool.submit(req("later", "true", begin=datetime.now(timezone.utc) + timedelta(hours=1)))
    assert e.value.code == "NoDeferredStart"
    with pytest.raises(ValueError, match="image=None"):
        pool.submit(req("no-image", "true", image=None))


def test_cancel_deletes_the_job_and_its_pods(pool, fake):
    info = pool.submit(req("stop-me", "sleep 60"))
    assert wait(pool, info.pool_job_id, {"running"}).state == "running"
    t0 = time.monotonic()
    done = pool.cancel(info.pool_job_id)
    assert time.monotonic() - t0 < 5
    assert (done.state, done.pool_state, done.reason, done.active) == \
        ("cancelled", "Cancelled", "cancelled by the broker", False)
    assert ("DELETE", "/apis/batch/v1/namespaces/default/jobs/fb-stop-me-a0", {"propagationPolicy": "Foreground"}) \
        in fake.requests
    assert fake.pods_of("fb-stop-me-a0") == []
    with pytest.raises(ProviderError) as e:
        pool.describe("fb-stop-me-a0")
    assert e.value.code == "NotFound"


@pytest.mark.parametrize("cascade", ["Background", "Foreground"])
def test_admin_deletion_is_reported_then_cleaned_up(pool, fake, cascade):
    info = pool.submit(req("admin-kills", "sleep 60"))
    assert wait(pool, info.pool_job_id, {"running"}).state == "running"
    # kubectl delete job fb-admin-kills-a0 --cascade=...: the finalizer keeps the Job visible
    status, _, _ = fake.handle("DELETE", "/apis/batch/v1/namespaces/default/jobs/fb-admin-kills-a0?propagationPolicy="
                               + cascade, b"")
    assert status == 200
    seen = pool.describe("fb-admin-kills-a0")
    # background: the pods run until the Job is gone; foreground: the pods went first
    assert (seen.state, seen.pool_state, seen.active) == ("cancelled", "Deleted", cascade == "Background")
    assert seen.reason == ("deleted in the cluster, not by the broker (Job fb-admin-kills-a0 was deleted by an "
                           "administrator or another controller)")
    assert [i.pool_job_id for i in pool.list_managed()] == (["fb-admin-kills-a0"] if cascade == "Background" else [])
    done = pool.cancel("fb-admin-kills-a0")
    assert (done.state, done.reason, done.active) == ("cancelled", seen.reason, False)
    assert ("default", "fb-admin-kills-a0") not in fake.jobs and fake.pods_of("fb-admin-kills-a0") == []


def test_eviction_is_interrupted_and_requeued(pool, fake):
    info = pool.submit(req("evicted", "sleep 60"))
    pod = fake.wait_pods(info.pool_job_id, "Running")[0]["metadata"]["name"]
    fake.evict(pod)
    done = wait(pool, info.pool_job_id, {"interrupted", "failed"})
    assert (done.state, done.pool_state, done.exit_code) == ("interrupted", "Evicted", 137)
    assert done.reason == (f"pod {pod} on a001: evicted by the kubelet (node pressure or shutdown) (The node was low "
                           "on resource: memory.): the broker requeues the attempt")


def test_node_lost_mid_run_is_interrupted(pool, fake):
    info = pool.submit(req("node-dies", "sleep 60", nodes=2))
    pods = fake.wait_pods(info.pool_job_id, "Running", n=2)
    fake.node_lost("a002")
    done = wait(pool, info.pool_job_id, {"interrupted", "failed"})
    lost = pods[1]["metadata"]["name"]
    assert (done.state, done.pool_state) == ("interrupted", "DeletionByTaintManager")
    assert done.reason == (f"pod {lost} (rank 1 of 2) on a002: its node was lost (NoExecute taint: not ready or "
                           "unreachable) (Taint manager: deleting due to NoExecute taint): the broker requeues the "
                           "attempt")


def test_oom_killed(pool, fake):
    info = pool.submit(req("oom", "sleep 60"))
    pod = fake.wait_pods(info.pool_job_id, "Running")[0]["metadata"]["name"]
    fake.oom_kill(pod)
    done = wait(pool, info.pool_job_id, {"failed"})
    assert (done.state, done.pool_state, done.exit_code) == ("failed", "OOMKilled", 137)
    assert done.reason == f"OOMKilled: pod {pod} ran out of memory (its limit or the node's; exit code 137)"


def test_unschedulable_stays_starting_with_the_scheduler_s_words_and_counts_as_backlog(pool, fake):
    fake.add_pod("big", "h001", 3)
    fake.add_pod("queued", None, 2, phase="Pending", node_selector={GPU_PRODUCT_LABEL: H100})
    fake.add_pod("queued-any", None, 1, phase="Pending")
    info = pool.submit(req("too-big", "true", gpu_type="h100", gpus=2))
    seen = wait(pool, info.pool_job_id, {"starting"})
    end = time.monotonic() + 5
    while seen.pool_state != "Unschedulable" and time.monotonic() < end:
        seen = pool.describe(info.pool_job_id)
    assert (seen.state, seen.pool_state, seen.active) == ("starting", "Unschedulable", True)
    assert seen.reason == ("Unschedulable: 0/5 nodes are available: 1 Insufficient nvidia.com/gpu, 4 node(s) didn't "
                           "match Pod's node affinity/selector. preemption: 0/5 nodes are available: 5 No preemption "
                           "victims found for incoming pod.")
    assert pool.backlog() == {"h100": 2, "gpu": 1}  # the broker's own pending pod is not the cluster's queue


def test_image_pull_backoff_fails_and_cancel_cleans_it(pool, fake):
    fake.missing_image("registry.example/missing:1")
    info = pool.submit(req("no-image", "true", image="registry.example/missing:1"))
    end = time.monotonic() + 5
    seen = pool.describe(info.pool_job_id)
    while seen.pool_state != "ImagePullBackOff" and time.monotonic() < end:
        seen = pool.describe(info.pool_job_id)
    assert (seen.state, seen.pool_state, seen.active) == ("failed", "ImagePullBackOff", True)
    assert seen.reason == ('ImagePullBackOff: Failed to pull image "registry.example/missing:1": rpc error: code = '
                           'NotFound desc = failed to pull and unpack image "registry.example/missing:1": not found')
    done = pool.cancel(info.pool_job_id)
    assert (done.state, done.pool_state, done.active) == ("failed", "ImagePullBackOff", False)
    assert ("default", info.pool_job_id) not in fake.jobs


def test_deadline_exceeded_fails_with_its_limit(pool, fake):
    info = pool.submit(req("slow", "sleep 60", deadline=datetime.now(timezone.utc) + timedelta(seconds=2)))
    assert info.time_limit_s in (1.0, 2.0)  # whole seconds left to the deadline
    done = wait(pool, info.pool_job_id, {"failed"})
    assert (done.state, done.pool_state, done.reason) == \
        ("failed", "DeadlineExceeded", f"reached its time limit (activeDeadlineSeconds={int(info.time_limit_s)})")


def test_sweep_cancels_forgotten_jobs_and_cleans_finished_ones(pool, fake):
    keep = pool.submit(req("keep", "sleep 60"))
    lost = pool.submit(req("forgotten", "sleep 60", attempt=2))
    old = pool.submit(req("finished", "true"))
    wait(pool, old.pool_job_id, {"succeeded"})
    wait(pool, lost.pool_job_id, {"running"})
    gone = pool.sweep({("keep", 0)}, grace_s=0)
    assert sorted(i.pool_job_id for i in gone) == ["fb-finished-a0", "fb-forgotten-a2"]
    assert [i.pool_job_id for i in pool.list_managed()] == [keep.pool_job_id]
    assert sorted(k[1] for k in fake.jobs) == ["fb-keep-a0"]
    pool.cancel(keep.pool_job_id, grace_s=0)


def test_release_profile_from_running_jobs_time_limits(pool, fake):
    info = pool.submit(req("holds", "sleep 60", gpus=2))
    wait(pool, info.pool_job_id, {"running"})
    start = fake.jobs[("default", info.pool_job_id)]["status"]["startTime"]
    t0 = datetime.fromisoformat(start.replace("Z", "+00:00"))
    assert pool.release_profile() == [(t0 + timedelta(seconds=372), "a100", 2)]
    pool.cancel(info.pool_job_id, grace_s=0)


def test_kueue_suspended_until_admitted(fake, tmp_path):
    pool = make_pool(fake, tmp_path, queue="kueue", kueue_queue="team-a")
    info = pool.submit(req("queued", "echo admitted"))
    assert (info.state, info.pool_state, info.reason) == \
        ("starting", "Suspended", "suspended: waiting for Kueue to admit it (LocalQueue team-a)")
    body = job_body(fake, info.pool_job_id)
    assert (body["spec"]["suspend"], body["metadata"]["labels"][KUEUE_QUEUE_LABEL]) == (True, "team-a")
    time.sleep(0.2)
    assert fake.pods_of(info.pool_job_id) == []
    fake.unsuspend(info.pool_job_id)
    done = wait(pool, info.pool_job_id, {"succeeded"})
    assert (done.state, pool.logs(info.pool_job_id)) == ("succeeded", "admitted\n")


# ---- API faults ------------------------------------------------------------------------------------------
def test_same_attempt_twice_is_a_409_conflict(pool):
    pool.submit(req("twice", "sleep 60"))
    with pytest.raises(ProviderError) as e:
        pool.submit(req("twice", "sleep 60"))
    assert (type(e.value), e.value.code) == (ProviderError, "Conflict")
    assert str(e.value) == 'create job: HTTP 409 jobs.batch "fb-twice-a0" already exists'


def test_429_is_retried_after_retry_after(pool, fake, sleeps):
    fake.throttle(2, retry_after_s=3)
    assert pool.free_gpus() == {"a100": 6, "h100": 4}
    assert sleeps == [3.0, 3.0]


def test_429_beyond_the_retries_is_throttled(pool, fake, sleeps):
    fake.throttle(4, retry_after_s=120)
    with pytest.raises(Throttled) as e:
        pool.capacity()
    assert (e.value.code, e.value.retry_after_s) == ("TooManyRequests", 60.0)  # capped at max_retry_after_s
    assert sleeps == [60.0, 60.0, 60.0]


def test_429_without_retry_after_backs_off_exponentially(pool, fake, sleeps):
    fake.throttle(3, retry_after_s=None)
    pool.capacity()
    assert sleeps == [1.0, 2.0, 4.0]


def test_403_exceeded_quota_is_quota_exceeded(pool, fake):
    fake.fail_next(403, "Forbidden", 'jobs.batch "fb-q-a0" is forbidden: exceeded quota: compute, requested: '
                   "count/jobs.batch=1, used: count/jobs.batch=10, limited: count/jobs.batch=10", method="POST")
    with pytest.raises(QuotaExceeded) as e:
        pool.submit(req("q", "true"))
    assert (e.value.code, e.value.option) == ("ExceededQuota", "kubernetes:default:a100")


def test_403_rbac_and_401_and_down_are_scheduler_unavailable(pool, fake, tmp_path):
    fake.fail_next(403, "Forbidden", 'nodes is forbidden: User "system:serviceaccount:default:broker" cannot list '
                   'resource "nodes" in API group "" at the cluster scope')
    with pytest.raises(SchedulerUnavailable) as e:
        pool.capacity()
    assert e.value.code == "Forbidden"
    fake.fail_next(503, "ServiceUnavailable", "etcdserver: leader changed")
    with pytest.raises(SchedulerUnavailable) as e:
        pool.capacity()
    assert e.value.code == "HTTP503"
    kc = tmp_path / "bad"
    kc.write_text(fake.kubeconfig(tmp_path / "good").read_text().replace("fake-k8s-token", "wrong"))
    bad = KubernetesPool(KubernetesSettings(kubeconfig=str(kc), context="fake"))
    with pytest.raises(SchedulerUnavailable) as e:
        bad.capacity()
    assert e.value.code == "Unauthorized"
    missing = KubernetesPool(KubernetesSettings(kubeconfig=str(tmp_path / "nope"), context="fake"))
    with pytest.raises(SchedulerUnavailable) as e:
        missing.capacity()
    assert e.value.code == "NoKubeconfig"
    # a new user's report: a plain-text file as kubeconfig gave "TypeError: 'str' object does not support item
    # assignment"; now the file is named with what is wrong, and its text (a token, maybe) is not echoed
    for name, text, why in [("plain", "SECRETTEXT not a kubeconfig\n", "TypeError"),
                            ("broken", "clusters: [SECRETTEXT\n", "ParserError at line 2, column 1")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(SchedulerUnavailable) as e:
            KubernetesPool(KubernetesSettings(kubeconfig=str(tmp_path / name), context="fake")).capacity()
        assert e.value.code == "NoKubeconfig"
        assert str(e.value).startswith(f"kubeconfig={str(tmp_path / name)!r}: not a valid kubeconfig (a YAML mapping "
                                       f"with clusters, contexts and users; the client failed with {why})"), str(e.value)
        assert "SECRETTEXT" not in str(e.value)
    host = fake.host
    fake.stop()
    down = KubernetesPool(KubernetesSettings(kubeconfig=str(tmp_path / "good"), context="fake"))
    with pytest.raises(SchedulerUnavailable) as e:
        down.capacity()
    assert e.value.code == "SchedulerUnavailable" and f"port={host.rsplit(':', 1)[1]}" in str(e.value)


# ---- names, settings and the pure state mapping ----------------------------------------------------------
def test_names_and_label_values():
    assert job_name("one-gpu", 3) == "fb-one-gpu-a3"
    long = "Job_With.Upper-and-a-very-long-name-" + "x" * 40
    name = job_name(long, 12)
    assert name == "fb-job-with-upper-and-a-ver-" + __import__("hashlib").sha256(long.encode()).hexdigest()[:8] + "-a12"
    assert len(name) <= 52
    assert job_name("A_b", 0) != job_name("a-b", 0)
    assert label_value("vision") == "vision"
    assert label_value("team.") == "h-" + __import__("hashlib").sha256(b"team.").hexdigest()[:16]


def test_settings_from_mapping_names_the_key():
    s = settings_from_mapping({"namespace": "ml", "gpu_products": {"a100": A100}, "max_retries": 5})
    assert (s.namespace, dict(s.gpu_products), s.max_retries) == ("ml", {"a100": A100}, 5)
    with pytest.raises(ValueError, match=r"kubernetes: unknown key\(s\) \['namespce'\]"):
        settings_from_mapping({"namespce": "ml"})
    with pytest.raises(ValueError, match=r"kubernetes.max_retries='3': must be an integer"):
        settings_from_mapping({"max_retries": "3"})
    with pytest.raises(ValueError, match=r"kubernetes: queue='volcano': must be 'none' or 'kueue'"):
        settings_from_mapping({"queue": "volcano"})
    with pytest.raises(ValueError, match=r"kubernetes: kueue_queue=None: queue is 'kueue'"):
        settings_from_mapping({"queue": "kueue"})
    with pytest.raises(ValueError, match=r"namespace='ML': must be a DNS label"):
        settings_from_mapping({"namespace": "ML"})


def test_time_limit_counts_the_deadline(pool):
    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    r = req("d", "true", deadline=now + timedelta(seconds=100.7))
    assert pool.time_limit_s(r, now=now.timestamp()) == 100
    assert pool.time_limit_s(req("d", "true"), now=now.timestamp()) == 372
    assert pool.time_limit_s(replace(req("d", "true"), time_limit_s=90.5), now=now.timestamp()) == 91  # its own
    with pytest.raises(Unsupported) as e:
        pool.time_limit_s(req("d", "true", deadline=now), now=now.timestamp())
    assert e.value.code == "DeadlinePassed"


def test_job_info_pending_without_pods_and_failed_create():
    job = {"metadata": {"name": "fb-x-a0", "uid": "u1", "annotations": {"fedbroker-job": "x"}},
           "spec": {"completions": 1}, "status": {}}
    info = job_info(job, [], [], now=0)
    assert (info.state, info.pool_state, info.reason, info.active, info.elapsed_s) == \
        ("starting", "Pending", "waiting for the Job controller to create its pods", True, None)
    ev = {"involvedObject": {"uid": "u1"}, "reason": "FailedCreate", "type": "Warning",
          "message": 'Error creating: pods "fb-x-a0-abcde" is forbidden: exceeded quota: gpu, requested: '
                     "requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8"}
    info = job_info(job, [], [ev], now=0)
    assert (info.state, info.pool_state) == ("starting", "FailedCreate")
    assert info.reason == "FailedCreate: " + ev["message"]


def test_job_info_partly_running_gang_and_other_failure_reasons():
    job = {"metadata": {"name": "fb-g-a0", "uid": "u2"},
           "spec": {"completions": 2, "activeDeadlineSeconds": 600},
           "status": {"startTime": "2026-12-01T12:00:00Z"}}
    index = "batch.kubernetes.io/job-completion-index"
    running = {"metadata": {"name": "fb-g-a0-0-aaaaa", "annotations": {index: "0"}},
               "spec": {"nodeName": "a001"}, "status": {"phase": "Running"}}
    pending = {"metadata": {"name": "fb-g-a0-1-bbbbb", "annotations": {index: "1"}},
               "spec": {}, "status": {"phase": "Pending"}}
    now = datetime(2026, 12, 1, 12, 0, 30, tzinfo=timezone.utc).timestamp()
    info = job_info(job, [pending, running], [], now=now)
    assert (info.state, info.pool_state, info.reason, info.nodes, info.elapsed_s, info.time_limit_s, info.active) == \
        ("starting", "Pending", "1 of 2 pods running, the others pending", "a001", 30.0, 600.0, True)
    job["status"]["conditions"] = [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                    "message": "Container job for pod default/x failed with exit code 2"}]
    info = job_info(job, [], [], now=now)
    assert (info.state, info.pool_state, info.reason, info.active) == \
        ("failed", "PodFailurePolicy", "PodFailurePolicy: Container job for pod default/x failed with exit code 2",
         False)


def test_settings_reject_a_bad_toleration_and_propagation():
    with pytest.raises(ValueError, match=r"tolerations: \{'key': 'x', 'operator': 'In'\} is not a toleration"):
        KubernetesSettings(tolerations=[{"key": "x", "operator": "In"}])
    with pytest.raises(ValueError, match=r"propagation='Orphan': must be 'Foreground' or 'Background'"):
        KubernetesSettings(propagation="Orphan")
