"""The cloud emulator (tests/e2e/cloudsim.py): instances of a fake cloud really run the user data
``providers.launch.cloud_init`` wrote, on this machine, with fake docker/aws/gcloud/ip commands.

AWS cases use a moto EC2 server (shared by the module; each test has its own broker id, so the
emulator of one test never boots another test's instances); the GCP case uses FakeGce.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import boto3
import pytest

from broker.model import JobSpec
from providers.aws import AwsCompute
from providers.base import InstanceRequest, idempotency_token, instance_tags
from providers.launch import DEFAULT_CHECKPOINT_ROOT, cloud_init, container_name, job_environment, launch_spec
from tests.e2e.cloudsim import FakeMetadata, InstanceEmulator, write_fake_tools
from tests.e2e.harness import wait_for

REGION = "us-east-1"
IMAGE = "ghcr.io/x/y@sha256:" + "a" * 64
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}

# the job's programs (python -c), all writing into $CHECKPOINT_DIR

ENV_DUMP = """
import json, os, pathlib, sys
d = pathlib.Path(os.environ["CHECKPOINT_DIR"])
(d / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))
(d / "model.pt").write_text("weights-1")
print("hello from rank", os.environ["NODE_RANK"], flush=True)
sys.exit(3)
"""

RESUME = """
import os, pathlib, sys
d = pathlib.Path(os.environ["CHECKPOINT_DIR"])
names = sorted(p.name for p in d.iterdir())
prev = (d / "model.pt").read_text() if (d / "model.pt").exists() else None
print("found", names, prev, flush=True)
(d / "model.pt").write_text(sys.argv[1])
"""

GRACEFUL = """
import os, pathlib, signal, sys, time
d = pathlib.Path(os.environ["CHECKPOINT_DIR"])
def on_term(sig, frame):
    (d / "sigterm.txt").write_text("got SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(d / "ready").write_text("1")
time.sleep(60)
"""

SLEEPER = """
import os, pathlib, time
(pathlib.Path(os.environ["CHECKPOINT_DIR"]) / "ready").write_text("1")
time.sleep(60)
"""


def py(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def user_data(command, job_id="job-1", attempt=1, rank=0, nnodes=1, master_addr="10.0.0.99", provider="aws",
              grace_s=5, **cloud_init_kw):
    """``(LaunchSpec, cloud-init script)`` for one rank of a job of team ``ml``."""
    spec = JobSpec(command=command, image=IMAGE, team="ml", nodes=nnodes)
    ls = launch_spec(spec, job_id, attempt, rank, nnodes, master_addr, grace_s=grace_s)
    return ls, cloud_init(ls, provider, **cloud_init_kw)


# ---- AWS fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url(moto_server):
    return moto_server


@pytest.fixture(scope="module")
def ec2(moto_url):
    return boto3.client("ec2", region_name=REGION, endpoint_url=moto_url, **CREDS)


@pytest.fixture(scope="module")
def ami(ec2):
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


@pytest.fixture
def broker_id():
    return f"broker-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def emu(tmp_path, moto_url, broker_id):
    with InstanceEmulator(tmp_path / "cloud", "aws", ec2_endpoint_url=moto_url, regions=[REGION],
                          path_rewrite=(DEFAULT_CHECKPOINT_ROOT, tmp_path / "disks"), broker_id=broker_id) as e:
        yield e
    assert e.errors == []


def run_instance(ec2, ami, broker_id, script) -> tuple[str, str]:
    """A tagged instance with ``script`` as user data: ``(instance id, private IP)``."""
    r = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="g5.xlarge", UserData=script,
                          TagSpecifications=[{"ResourceType": "instance",
                                              "Tags": [{"Key": "fedbroker-broker", "Value": broker_id}]}])
    inst = r["Instances"][0]
    return inst["InstanceId"], inst["PrivateIpAddress"]


def docker_log(emu, iid, ls) -> str:
    return (emu.instances()[iid].dir / "log" / f"{container_name(ls)}.log").read_text()


# ---- the harness's parts -----------------------------------------------------------------------


def _get(url, headers=None, method="GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_fake_metadata_answers_imdsv2_and_gce_and_raises_the_notice():
    with FakeMetadata(private_ip="10.0.0.7", instance_id="i-1") as md:
        u = md.url
        assert u.startswith("http://127.0.0.1:")
        assert _get(f"{u}/latest/api/token", method="PUT")[0] == 400  # no TTL header
        status, token = _get(f"{u}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        assert status == 200 and len(token) >= 32
        action = f"{u}/latest/meta-data/spot/instance-action"
        assert _get(action)[0] == 401
        assert _get(action, {"X-aws-ec2-metadata-token": "wrong"})[0] == 401
        assert _get(action, {"X-aws-ec2-metadata-token": token})[0] == 404
        assert _get(f"{u}/latest/meta-data/local-ipv4", {"X-aws-ec2-metadata-token": token}) == (200, "10.0.0.7")
        pre = f"{u}/computeMetadata/v1/instance/preempted"
        assert _get(pre)[0] == 403
        assert _get(pre, {"Metadata-Flavor": "Google"}) == (200, "FALSE")

        md.notice()
        status, body = _get(action, {"X-aws-ec2-metadata-token": token})
        assert status == 200
        doc = json.loads(body)
        assert doc["action"] == "terminate"
        at = datetime.strptime(doc["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        assert abs(at - (datetime.now(timezone.utc) + timedelta(seconds=120))) < timedelta(seconds=5)
        assert _get(pre, {"Metadata-Flavor": "Google"}) == (200, "TRUE")
        assert md.requests["/latest/api/token"] == 2
        assert md.requests["/latest/meta-data/spot/instance-action"] == 4
        assert md.requests["/computeMetadata/v1/instance/preempted"] == 3


@pytest.fixture
def tools(tmp_path):
    bin_dir = tmp_path / "bin"
    write_fake_tools(bin_dir)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_OBJECT_STORE": str(tmp_path / "store"),
           "FAKE_DOCKER_STATE": str(tmp_path / "docker"), "FAKE_PRIVATE_IP": "10.9.8.7", "FROM_CALLER": "yes"}

    def run(*argv, **kw):
        return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=30, **kw)

    run.env = env
    return run


def test_fake_docker_runs_the_command_with_the_container_environment(tools, tmp_path):
    assert tools("docker", "info").returncode == 0
    code = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]})); sys.exit(7)"
    r = tools("docker", "run", "--rm", "--name", "c1", "--init", "--gpus", '"device=0,1"', "--network", "host",
              "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864", "--stop-timeout", "3",
              "-v", f"{tmp_path}/ck:/checkpoints", "-e", "CHECKPOINT_DIR=/checkpoints", "-e", "A=1", "-e", "A=2",
              "-e", "FROM_CALLER", "-e", "MISSING", IMAGE, sys.executable, "-c", code,
              "CHECKPOINT_DIR", "A", "FROM_CALLER", "MISSING", "FAKE_PRIVATE_IP")
    assert r.returncode == 7, r.stderr
    assert json.loads(r.stdout) == {"CHECKPOINT_DIR": f"{tmp_path}/ck", "A": "2", "FROM_CALLER": "yes",
                                    "MISSING": None, "FAKE_PRIVATE_IP": "10.9.8.7"}
    assert list((tmp_path / "docker").iterdir()) == []  # pid file gone with the container
    assert tools("docker", "run", "--privileged", IMAGE, "true").returncode == 125
    assert tools("docker", "run", IMAGE, "/no/such/program").returncode == 127


def test_fake_docker_stop_sends_sigterm_then_sigkill(tools, tmp_path):
    r = tools("docker", "stop", "-t", "1", "nobody")
    assert r.returncode == 0 and "No such container: nobody" in r.stderr

    def start(name, code):
        ready = tmp_path / f"{name}.ready"
        p = subprocess.Popen(["docker", "run", "--rm", "--name", name, IMAGE, sys.executable, "-c", code, str(ready)],
                             env=tools.env)
        wait_for(ready.exists, 10, f"{name} ready")
        return p

    term = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('1'); time.sleep(30)"
    p = start("c2", term)
    pid = int((tmp_path / "docker" / "c2.pid").read_text())
    assert pid != p.pid  # the command's own process
    t0 = time.monotonic()
    assert tools("docker", "stop", "-t", "5", "c2").returncode == 0
    assert p.wait(timeout=10) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 3

    deaf = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).write_text('1'); time.sleep(30)")
    p = start("c3", deaf)
    t0 = time.monotonic()
    assert tools("docker", "stop", "-t", "1", "c3").returncode == 0
    assert p.wait(timeout=10) == 128 + signal.SIGKILL
    assert 0.9 < time.monotonic() - t0 < 4

    p = start("c4", term)
    os.kill(p.pid, signal.SIGTERM)  # the docker client itself: forwarded to the command
    assert p.wait(timeout=10) == 143


def test_fake_aws_and_gcloud_sync_with_the_local_object_store(tools, tmp_path):
    src = tmp_path / "ck"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("A1")
    (src / "sub" / "b.txt").write_text("B1")
    store = tmp_path / "store" / "bkt" / "ml" / "job"
    store.mkdir(parents=True)
    (store / "old.txt").write_text("kept")
    (store / "a.txt").write_text("stale")

    r = tools("aws", "s3", "sync", "--only-show-errors", str(src), "s3://bkt/ml/job")
    assert (r.returncode, r.stdout) == (0, "")
    assert {p.relative_to(store).as_posix(): p.read_text() for p in store.rglob("*") if p.is_file()} == \
        {"a.txt": "A1", "sub/b.txt": "B1", "old.txt": "kept"}
    r = tools("aws", "s3", "sync", "s3://bkt/none", str(tmp_path / "empty"))
    assert r.returncode == 0 and not (tmp_path / "empty").exists()
    assert tools("aws", "ec2", "describe-instances").returncode == 2

    out = tmp_path / "restored"
    assert tools("gcloud", "storage", "rsync", "--recursive", "--quiet", "gs://bkt/ml/job", str(out)).returncode == 0
    assert (out / "sub" / "b.txt").read_text() == "B1" and (out / "old.txt").read_text() == "kept"
    flat = tmp_path / "flat"
    assert tools("gcloud", "storage", "rsync", "gs://bkt/ml/job", str(flat)).returncode == 0
    assert sorted(p.name for p in flat.iterdir()) == ["a.txt", "old.txt"]  # top level only without --recursive
    assert tools("gcloud", "compute", "instances", "list").returncode == 2


def test_fake_ip_gives_the_launcher_its_interface_and_address(tools):
    r = tools("bash", "-c", "ip -o -4 route show to default | awk '{print $5}' | head -n 1; "
                            "ip -o -4 addr show dev ens5 | awk '{print $4}' | cut -d/ -f1 | head -n 1")
    assert r.stdout.split() == ["ens5", "10.9.8.7"]


# ---- AWS instances -----------------------------------------------------------------------------


@pytest.mark.parametrize("rank,master_addr_at_boot", [(1, False), (0, True)])
def test_rank_gets_its_environment_exit_status_and_checkpoint_upload(emu, ec2, ami, broker_id, rank,
                                                                     master_addr_at_boot):
    spec = JobSpec(command=["x"], image=IMAGE, team="ml", nodes=2)
    keys = sorted(job_environment(launch_spec(spec, "job-1", 1, rank, 2, "10.0.0.99"))) + ["NCCL_SOCKET_IFNAME"]
    ls, script = user_data(py(ENV_DUMP, *keys), rank=rank, nnodes=2, checkpoint_uri="s3://ckpt-bucket/ml/job-1",
                           master_addr_at_boot=master_addr_at_boot)
    iid, private_ip = run_instance(ec2, ami, broker_id, script)

    assert emu.wait(emu.wait_booted(iid).instance_id) == 3
    state = emu.instances()[iid]
    assert state.returncode == 3 and state.private_ip == private_ip and not state.terminated
    console = emu.console(iid)
    assert f"container {container_name(ls)} exited with status 3" in console
    user_data_sh = (state.dir / "user-data.sh").read_text()
    assert DEFAULT_CHECKPOINT_ROOT not in user_data_sh

    local = emu.local_dir(iid) / "ml" / "job-1"
    assert (local / "model.pt").read_text() == "weights-1"
    stored = emu.object_store / "ckpt-bucket" / "ml" / "job-1"
    assert (stored / "model.pt").read_text() == "weights-1"
    assert json.loads((stored / "env.json").read_text()) == json.loads((local / "env.json").read_text())

    expected = job_environment(ls)
    expected["CHECKPOINT_DIR"] = str(local)
    expected["NCCL_SOCKET_IFNAME"] = "ens5"
    if master_addr_at_boot:
        expected["MASTER_ADDR"] = expected["PET_MASTER_ADDR"] = private_ip
    else:
        assert expected["MASTER_ADDR"] == "10.0.0.99"
    assert json.loads((local / "env.json").read_text()) == expected
    assert docker_log(emu, iid, ls) == f"hello from rank {rank}\n"


def test_next_instance_restores_the_checkpoint_from_the_object_store(emu, ec2, ami, broker_id):
    uri = "s3://ckpt-bucket/ml/job-b"
    ls1, s1 = user_data(py(RESUME, "step-1"), job_id="job-b", attempt=1, checkpoint_uri=uri)
    first, _ = run_instance(ec2, ami, broker_id, s1)
    assert emu.wait(emu.wait_booted(first).instance_id) == 0
    assert docker_log(emu, first, ls1) == "found [] None\n"

    ls2, s2 = user_data(py(RESUME, "step-2"), job_id="job-b", attempt=2, checkpoint_uri=uri)
    second, _ = run_instance(ec2, ami, broker_id, s2)
    assert emu.wait(emu.wait_booted(second).instance_id) == 0
    assert docker_log(emu, second, ls2) == "found ['model.pt'] step-1\n"

    assert (emu.local_dir(first) / "ml" / "job-b" / "model.pt").read_text() == "step-1"  # its own disk
    assert (emu.local_dir(second) / "ml" / "job-b" / "model.pt").read_text() == "step-2"
    assert (emu.object_store / "ckpt-bucket" / "ml" / "job-b" / "model.pt").read_text() == "step-2"


def test_spot_notice_gives_the_job_sigterm_and_its_checkpoint_is_uploaded(emu, ec2, ami, broker_id):
    ls, script = user_data(py(GRACEFUL), job_id="job-c", checkpoint_uri="s3://ckpt-bucket/ml/job-c")
    iid, _ = run_instance(ec2, ami, broker_id, script)
    emu.wait_booted(iid)
    local = emu.local_dir(iid) / "ml" / "job-c"
    wait_for((local / "ready").exists, 10, "the job to start")

    t0 = time.monotonic()
    emu.notice(iid)
    wait_for((local / "sigterm.txt").exists, 10, "SIGTERM in the job", interval=0.05)
    assert time.monotonic() - t0 < 8  # AWS notice polled every 5 s (+ curl, docker stop)
    assert emu.wait(iid) == 0
    assert (local / "sigterm.txt").read_text() == "got SIGTERM"
    assert (emu.object_store / "ckpt-bucket" / "ml" / "job-c" / "sigterm.txt").read_text() == "got SIGTERM"
    console = emu.console(iid)
    assert f"EC2 spot interruption notice: docker stop -t 5 {container_name(ls)}" in console
    assert "exited with status 0" in console
    reqs = emu.metadata(iid).requests
    assert reqs["/latest/api/token"] >= 1
    assert reqs["/latest/meta-data/spot/instance-action"] >= 2  # polled before and after the notice
    assert reqs["/latest/api/token"] == reqs["/latest/meta-data/spot/instance-action"]


def test_terminated_instance_stops_the_container_and_exits_143(emu, ec2, ami, broker_id):
    ls, script = user_data(py(SLEEPER), job_id="job-d")
    iid, _ = run_instance(ec2, ami, broker_id, script)
    state = emu.wait_booted(iid)
    wait_for((emu.local_dir(iid) / "ml" / "job-d" / "ready").exists, 10, "the job to start")
    pidfile = state.dir / "docker" / f"{container_name(ls)}.pid"
    job_pid = int(pidfile.read_text())

    t0 = time.monotonic()
    ec2.terminate_instances(InstanceIds=[iid])
    assert emu.wait(iid, timeout_s=10) == 143
    assert time.monotonic() - t0 < 4  # SIGTERM did it, not the SIGKILL 5 s later
    assert emu.instances()[iid].terminated
    console = emu.console(iid)
    assert f"received SIGTERM: docker stop -t 5 {container_name(ls)}" in console
    assert f"container {container_name(ls)} exited with status 143" in console
    assert not pidfile.exists()
    assert not Path(f"/proc/{job_pid}").exists() or \
        Path(f"/proc/{job_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


class _Reports:
    """A tiny broker report endpoint: records (path, Authorization, form fields) of each POST."""

    def __init__(self):
        self.posts: list[tuple[str, str | None, dict[str, list[str]]]] = []
        rec = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                rec.posts.append((self.path, self.headers.get("Authorization"),
                                  parse_qs(body, keep_blank_values=True)))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/instances/report"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_report_hook_posts_running_then_exited_with_the_log_tail(emu, moto_url, ami, broker_id):
    reports = _Reports()
    token = "tok_" + uuid.uuid4().hex
    try:
        code = "import sys; print('hello-from-the-job', flush=True); sys.exit(3)"
        ls, script = user_data(py(code), job_id="job-e", attempt=2, report_url=reports.url, report_token=token)
        aws = AwsCompute(region_clients=lambda r: boto3.client("ec2", region_name=r, endpoint_url=moto_url, **CREDS),
                         ami_by_region={REGION: ami})
        offer = f"aws:{REGION}b:g5.xlarge:on_demand"
        info = aws.launch(InstanceRequest(
            job_id="job-e", attempt=2, rank=0, team="ml", offer_id=offer, region=REGION, zone=f"{REGION}b",
            instance_type="g5.xlarge", market="on_demand", gpu_type="A10G", gpu_count=1, user_data=script,
            tags=instance_tags("job-e", 2, 0, "ml", broker_id), token=idempotency_token("job-e", 2, offer, 0)))

        assert emu.wait(emu.wait_booted(info.instance_id).instance_id) == 3
        assert emu.instances()[info.instance_id].private_ip == info.private_ip
        assert [p[2]["event"] for p in reports.posts] == [["running"], ["exited"]]
        for path, auth, form in reports.posts:
            assert path == "/v1/instances/report"
            assert auth == f"Bearer {token}"
            assert (form["job_id"], form["attempt"], form["rank"]) == (["job-e"], ["2"], ["0"])
        running, exited = (p[2] for p in reports.posts)
        assert (running["seq"], exited["seq"]) == (["1"], ["2"])  # the rank's report counter (replay protection)
        assert running["exit_code"] == [""] and "log_tail" not in running
        assert exited["exit_code"] == ["3"] and exited["reason"] == [""]
        assert exited["log_tail"] == ["hello-from-the-job\n"]
    finally:
        reports.close()


# ---- GCP ---------------------------------------------------------------------------------------


def test_gcp_instance_runs_and_sees_the_preemption_notice(tmp_path, broker_id):
    pytest.importorskip("google.cloud.compute_v1")
    from providers.gcp import GcpCompute
    from tests.providers.fake_gce import FakeGce

    zone = "us-central1-a"
    with FakeGce("test-project", wait_block_s=0.1) as fake, \
            InstanceEmulator(tmp_path / "cloud", "gcp", fake_gce=fake, broker_id=broker_id,
                             path_rewrite=(DEFAULT_CHECKPOINT_ROOT, tmp_path / "disks")) as emu:
        gcp = GcpCompute.for_endpoint("test-project", fake.endpoint, op_timeout_s=5.0, poll_interval_s=0.02)
        ls, script = user_data(py(GRACEFUL), job_id="job-g", provider="gcp",
                               checkpoint_uri="gs://ckpt-bucket/ml/job-g")
        offer = f"gcp:{zone}:n1-standard-8:spot"
        info = gcp.launch(InstanceRequest(
            job_id="job-g", attempt=1, rank=0, team="ml", offer_id=offer, region="us-central1", zone=zone,
            instance_type="n1-standard-8", market="spot", gpu_type="T4", gpu_count=1, user_data=script,
            tags=instance_tags("job-g", 1, 0, "ml", broker_id), token=idempotency_token("job-g", 1, offer, 0)))

        state = emu.wait_booted(info.instance_id)
        assert state.private_ip == info.private_ip == fake.instances_in()[0]["networkInterfaces"][0]["networkIP"]
        local = emu.local_dir(info.instance_id) / "ml" / "job-g"
        wait_for((local / "ready").exists, 10, "the job to start")

        t0 = time.monotonic()
        emu.notice(info.instance_id)
        wait_for((local / "sigterm.txt").exists, 10, "SIGTERM in the job", interval=0.05)
        assert time.monotonic() - t0 < 3  # GCE notice polled every 1 s
        assert emu.wait(info.instance_id) == 0
        assert (emu.object_store / "ckpt-bucket" / "ml" / "job-g" / "sigterm.txt").read_text() == "got SIGTERM"
        console = emu.console(info.instance_id)
        assert f"GCE preemption notice: docker stop -t 5 {container_name(ls)}" in console
        assert emu.metadata(info.instance_id).requests["/computeMetadata/v1/instance/preempted"] >= 2

        fake.preempt(zone, info.instance_id)  # spot VM deleted: the emulator sees it gone
        wait_for(lambda: emu.instances()[info.instance_id].terminated, 5, "the emulator to see the preemption")
        assert emu.errors == []
