"""providers.launch: one environment, one ``docker run`` and one cloud-init script per rank.

The cloud-init scripts are checked with ``bash -n`` and run for real under bash with fake
``docker``, ``ip`` and ``curl`` programs first on ``PATH`` (no container, no cloud).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.model import JobSpec
from providers.launch import (RENDEZVOUS_PORT, LaunchSpec, cloud_init, default_route_interface, docker_argv,
                              job_environment, launch_spec, pin_image, process_environment, scheduler_environment)

DIGEST = "sha256:" + "ab" * 32
IMAGE = f"ghcr.io/fedbroker/nccl-train@{DIGEST}"
JOB = "job-0123456789abcdef"
CMD = ["torchrun", "train.py", "--epochs", "3"]
EVIL = ["python", "-c", "print('a; rm -rf /')", "$(reboot)"]


def spec(command=CMD, image=IMAGE, **kw) -> JobSpec:
    kw.setdefault("gpus_per_node", 2)
    kw.setdefault("nodes", 2)
    kw.setdefault("team", "ml")
    return JobSpec(command=command, image=image, **kw)


def ranks(js: JobSpec, root: str = "/var/lib/fedbroker/checkpoints", onprem: bool = False, ifname=None):
    return [launch_spec(js, JOB, 2, r, 2, "10.0.0.11", gpu_devices=(0, 1) if onprem else (),
                        checkpoint_root=root, nccl_socket_ifname=ifname) for r in (0, 1)]


def docker_line(script: str) -> str:
    """The one ``docker run`` line of a cloud-init script, without its trailing ``&``."""
    lines = [ln for ln in script.splitlines() if ln.startswith("docker run ")]
    assert len(lines) == 1, lines
    assert lines[0].endswith(' >>"$LOG" 2>&1 &')
    return lines[0][:-len(' >>"$LOG" 2>&1 &')]


# ----------------------------------------------------------------------------- spec and environment

def test_launch_spec_of_each_rank():
    r0, r1 = ranks(spec())
    assert r1 == LaunchSpec(job_id=JOB, attempt=2, rank=1, nnodes=2, gpus_per_node=2, image=IMAGE,
                            command=tuple(CMD), gpu_devices=(), master_addr="10.0.0.11", master_port=29500,
                            nccl_socket_ifname=None, checkpoint_dir=f"/var/lib/fedbroker/checkpoints/ml/{JOB}",
                            grace_s=30, team="ml")
    assert r0 == LaunchSpec(**{**r1.__dict__, "rank": 0})
    assert RENDEZVOUS_PORT == 29500
    # the checkpoint directory is per job: every attempt sees the same one
    assert launch_spec(spec(), JOB, 7, 0, 2, "10.0.0.11").checkpoint_dir == r0.checkpoint_dir
    assert launch_spec(spec(), JOB, 1, 0, 2, "h", grace_s=2.5).grace_s == 3


def test_job_environment_is_exact():
    ls = launch_spec(spec(), JOB, 2, 1, 2, "10.0.0.11", gpu_devices=(2, 3), nccl_socket_ifname="ens5")
    assert job_environment(ls) == {
        "NODE_RANK": "1", "NNODES": "2", "GPUS_PER_NODE": "2", "WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.11", "MASTER_PORT": "29500",
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "10.0.0.11", "PET_MASTER_PORT": "29500", "PET_RDZV_ID": f"{JOB}-2",
        "FEDBROKER_JOB_ID": JOB, "FEDBROKER_ATTEMPT": "2", "FEDBROKER_RANK": "1",
        "CHECKPOINT_DIR": "/checkpoints", "NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ens5",
    }
    assert "NCCL_SOCKET_IFNAME" not in job_environment(ranks(spec())[1])


def test_process_environment_leaves_runtime_keys_to_the_runtime():
    ls = launch_spec(spec(), JOB, 2, 1, 2, "n1", gpu_devices=(2, 3), checkpoint_root="/srv/ckpt")
    env = process_environment(ls)
    assert not {"CUDA_VISIBLE_DEVICES", "FEDBROKER_JOB_ID", "FEDBROKER_ATTEMPT", "FEDBROKER_RANK"} & set(env)
    assert env["CHECKPOINT_DIR"] == f"/srv/ckpt/ml/{JOB}"
    assert {k: v for k, v in env.items() if k != "CHECKPOINT_DIR"} == {
        k: v for k, v in job_environment(ls).items() if not k.startswith("FEDBROKER_") and k != "CHECKPOINT_DIR"}


def test_scheduler_environment_leaves_per_node_keys_to_the_scheduler_s_script():
    ls = launch_spec(spec(), JOB, 2, 0, 2, "localhost", checkpoint_root="/srv/ckpt")
    assert scheduler_environment(ls) == {
        "NNODES": "2", "GPUS_PER_NODE": "2", "WORLD_SIZE": "4", "MASTER_PORT": "29500",
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_MASTER_PORT": "29500", "PET_RDZV_ID": f"{JOB}-2",
        "CHECKPOINT_DIR": f"/srv/ckpt/ml/{JOB}", "NCCL_DEBUG": "WARN"}


def test_docker_argv_is_exact():
    ls = launch_spec(spec(image="registry.local:5000/team/train:v3"), JOB, 2, 1, 2, "10.0.0.11",
                     gpu_devices=(2, 3), nccl_socket_ifname="ens5", grace_s=45)
    env = job_environment(ls)
    assert docker_argv(ls) == [
        "docker", "run", "--rm", "--name", f"fedbroker-{JOB}-2-1", "--init", "--gpus", '"device=2,3"',
        "--network", "host", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev",
        "--stop-timeout", "45", "-v", f"/var/lib/fedbroker/checkpoints/ml/{JOB}:/checkpoints",
        *[w for k, v in env.items() for w in ("-e", f"{k}={v}")],
        "registry.local:5000/team/train:v3", "torchrun", "train.py", "--epochs", "3",
    ]
    # the interface unknown here: passed through from the launching shell (cloud-init exports it)
    cloud = ranks(spec())[1]
    assert docker_argv(cloud)[-len(CMD) - 3:] == ["-e", "NCCL_SOCKET_IFNAME", IMAGE, *CMD]
    assert docker_argv(cloud)[7] == "all"


def test_docker_argv_single_node_has_no_host_network_and_never_a_broker_variable(monkeypatch):
    monkeypatch.setenv("FEDBROKER_TOKEN", "secret-token-value")
    monkeypatch.setenv("FEDBROKER_DATABASE_URL", "postgresql://u:pw@db/x")
    ls = launch_spec(spec(nodes=1), JOB, 1, 0, 1, "127.0.0.1", gpu_devices=(0, 1), nccl_socket_ifname="ens5",
                     grace_s=10)
    env = job_environment(ls)
    assert docker_argv(ls, user="1001:1001") == [
        "docker", "run", "--rm", "--name", f"fedbroker-{JOB}-1-0", "--init", "--gpus", '"device=0,1"',
        "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev",
        "--user", "1001:1001",
        "--stop-timeout", "10", "-v", f"/var/lib/fedbroker/checkpoints/ml/{JOB}:/checkpoints",
        *[w for k, v in env.items() for w in ("-e", f"{k}={v}")],
        IMAGE, *CMD,
    ]
    assert docker_argv(ls, read_only=False) == [
        w for w in docker_argv(ls) if w not in ("--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev")]
    e_words = [a for i, a in enumerate(docker_argv(ls)) if i and docker_argv(ls)[i - 1] == "-e"]
    assert sorted(w.split("=")[0] for w in e_words) == sorted(env)
    assert [k for k in env if k.startswith("FEDBROKER_")] == ["FEDBROKER_JOB_ID", "FEDBROKER_ATTEMPT", "FEDBROKER_RANK"]
    for bad in ("root", "0", "0:0", "root:users", "a b", "x;y"):
        with pytest.raises(ValueError, match="user="):
            docker_argv(ls, user=bad)


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_cloud_init_runs_exactly_docker_argv_on_every_rank(provider):
    cloud = ranks(spec())
    onprem = ranks(spec(), onprem=True)
    lines = []
    for ls, op in zip(cloud, onprem):
        script = cloud_init(ls, provider)
        assert script.startswith("#!/bin/bash\n")
        line = shlex.split(docker_line(script))
        assert line == docker_argv(ls)
        # the on-prem container of the same rank differs only in the GPU list
        g = line.index("--gpus")
        assert (line[g + 1], docker_argv(op)[g + 1]) == ("all", '"device=0,1"')
        assert line[:g + 1] + line[g + 2:] == docker_argv(op)[:g + 1] + docker_argv(op)[g + 2:]
        lines.append(line)
    # both ranks: the same image, command and NCCL/rendezvous environment; only the rank differs
    for line in lines:
        assert line[-len(CMD) - 1:] == [IMAGE, *CMD]

    def env(line):
        return [line[i + 1] for i, w in enumerate(line) if w == "-e"]

    rank_keys = {"NODE_RANK", "PET_NODE_RANK", "FEDBROKER_RANK"}
    e0, e1 = env(lines[0]), env(lines[1])
    assert [x for x in e0 if x.split("=")[0] not in rank_keys] == [x for x in e1 if x.split("=")[0] not in rank_keys]
    assert [x for x in e0 if x.split("=")[0] in rank_keys] == ["NODE_RANK=0", "PET_NODE_RANK=0", "FEDBROKER_RANK=0"]
    assert [x for x in e1 if x.split("=")[0] in rank_keys] == ["NODE_RANK=1", "PET_NODE_RANK=1", "FEDBROKER_RANK=1"]
    assert {"MASTER_ADDR=10.0.0.11", "MASTER_PORT=29500", "WORLD_SIZE=4", "NCCL_DEBUG=WARN",
            "NCCL_SOCKET_IFNAME"} <= set(e0)


def test_cloud_init_watches_the_provider_notice():
    ls = ranks(spec())[0]
    aws, gcp = cloud_init(ls, "aws"), cloud_init(ls, "gcp")
    assert 'IMDS_URL="${FEDBROKER_IMDS_URL:-http://169.254.169.254}"' in aws
    assert '"$IMDS_URL/latest/meta-data/spot/instance-action"' in aws
    assert "X-aws-ec2-metadata-token" in aws and "metadata.google.internal" not in aws
    assert 'GCE_METADATA_URL="${FEDBROKER_GCE_METADATA_URL:-http://metadata.google.internal}"' in gcp
    assert '"$GCE_METADATA_URL/computeMetadata/v1/instance/preempted"' in gcp
    assert "Metadata-Flavor: Google" in gcp and "169.254.169.254" not in gcp
    assert "ip -o -4 route show to default | awk '{print $5}'" in aws
    with pytest.raises(ValueError, match="provider='azure'"):
        cloud_init(ls, "azure")
    # an interface known in advance is passed as a value, nothing computed at boot
    known = launch_spec(spec(), JOB, 2, 0, 2, "10.0.0.11", nccl_socket_ifname="ens5")
    assert "ip -o -4 route" not in cloud_init(known, "aws")
    assert "NCCL_SOCKET_IFNAME=ens5" in shlex.split(docker_line(cloud_init(known, "aws")))


# ----------------------------------------------------------------------------- image pinning

def test_cloud_launch_needs_an_image_pinned_by_digest():
    tagged = ranks(spec(image="ghcr.io/fedbroker/nccl-train:latest"))[0]
    with pytest.raises(ValueError, match=r"image='ghcr.io/fedbroker/nccl-train:latest': must be pinned by digest"):
        cloud_init(tagged, "aws")
    with pytest.raises(ValueError, match="must be pinned by digest"):
        pin_image("ghcr.io/fedbroker/nccl-train")
    assert pin_image(IMAGE) == IMAGE
    assert docker_argv(tagged)[-len(CMD) - 1] == "ghcr.io/fedbroker/nccl-train:latest"  # on-prem takes tags
    # a resolver may pin it: the bare digest or a full reference
    assert pin_image("ghcr.io/x/y:v1", lambda im: DIGEST) == f"ghcr.io/x/y:v1@{DIGEST}"
    assert pin_image("ghcr.io/x/y:v1", lambda im: f"ghcr.io/x/y@{DIGEST}") == f"ghcr.io/x/y@{DIGEST}"
    with pytest.raises(ValueError, match="resolver returned 'latest'"):
        pin_image("ghcr.io/x/y:v1", lambda im: "latest")
    script = cloud_init(tagged, "gcp", resolve=lambda im: DIGEST)
    assert shlex.split(docker_line(script))[-len(CMD) - 1] == f"ghcr.io/fedbroker/nccl-train:latest@{DIGEST}"


def test_bad_launch_specs_name_the_field():
    js = spec()
    with pytest.raises(ValueError, match="rank=2"):
        launch_spec(js, JOB, 1, 2, 2, "h")
    with pytest.raises(ValueError, match="nnodes=3"):
        launch_spec(js, JOB, 1, 0, 3, "h")
    with pytest.raises(ValueError, match="gpu_devices"):
        launch_spec(js, JOB, 1, 0, 2, "h", gpu_devices=(0,))
    with pytest.raises(ValueError, match="master_addr"):
        launch_spec(js, JOB, 1, 0, 2, "h; reboot")
    with pytest.raises(ValueError, match="job_id"):
        launch_spec(js, "job/../x", 1, 0, 2, "h")
    with pytest.raises(ValueError, match="nccl_socket_ifname"):
        launch_spec(js, JOB, 1, 0, 2, "h", nccl_socket_ifname="eth0 $(x)")
    with pytest.raises(ValueError, match="checkpoint_root"):
        launch_spec(js, JOB, 1, 0, 2, "h", checkpoint_root="relative")
    with pytest.raises(ValueError, match="grace_s"):
        launch_spec(js, JOB, 1, 0, 2, "h", grace_s=-1)


def test_default_route_interface(tmp_path):
    f = tmp_path / "route"
    f.write_text("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
                 "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
                 "wlan0\t00000000\t0100A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0\n"
                 "ens5\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n")
    assert default_route_interface(str(f)) == "ens5"
    assert default_route_interface(str(tmp_path / "missing")) is None


# ----------------------------------------------------------------------------- running the script

FAKE_DOCKER = """#!{python}
import json, os, pathlib, sys, time
d = pathlib.Path(os.environ["FAKE_DIR"])
with open(d / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "ifname": os.environ.get("NCCL_SOCKET_IFNAME")}}) + "\\n")
cmd = sys.argv[1] if len(sys.argv) > 1 else ""
if cmd == "run" and os.environ.get("FAKE_DOCKER_PRINT"):
    print(json.dumps(["docker", *sys.argv[1:]]))
elif cmd == "run":
    (d / "running").touch()
    for _ in range(400):
        if (d / "stopped").exists():
            sys.exit(143)
        time.sleep(0.05)
    sys.exit(99)
elif cmd == "stop":
    (d / "stopped").touch()
"""

FAKE_IP = """#!/bin/sh
echo "default via 10.0.0.1 dev ens5 proto dhcp src 10.0.0.12 metric 100"
"""

FAKE_CURL = """#!/bin/sh
echo "$*" >> "$FAKE_DIR/curl.log"
for a in "$@"; do
  case "$a" in
    */api/token) echo tok; exit 0 ;;
    */spot/instance-action) if [ -n "$FAKE_NOTICE" ]; then echo 200; else echo 404; fi; exit 0 ;;
    */instance/preempted) if [ -n "$FAKE_NOTICE" ]; then echo TRUE; else echo FALSE; fi; exit 0 ;;
  esac
done
exit 7
"""


@pytest.fixture
def fakes(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("docker", FAKE_DOCKER.format(python=sys.executable)), ("ip", FAKE_IP), ("curl", FAKE_CURL)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    d = tmp_path / "fake"
    d.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NCCL_SOCKET_IFNAME"}
    env.update(PATH=f"{bin_}:{os.environ['PATH']}", FAKE_DIR=str(d))
    return d, env


def calls(d: Path) -> list[dict]:
    p = d / "calls.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_shell_metacharacters_reach_docker_only_as_quoted_words(provider, fakes, tmp_path):
    _, env = fakes
    ls = launch_spec(spec(command=EVIL), JOB, 1, 1, 2, "10.0.0.11")
    script = cloud_init(ls, provider)
    f = tmp_path / "user-data.sh"
    f.write_text(script)
    subprocess.run(["bash", "-n", str(f)], check=True)
    # every metacharacter-bearing word appears only inside its single-quoted form
    for word in EVIL[2:]:
        assert script.count(shlex.quote(word)) == 1
    assert script.count("$(reboot)") == script.count("'$(reboot)'") == 1
    assert script.count("a; rm -rf /") == script.count("'a; rm -rf /'") == 1
    assert shlex.quote("print('a; rm -rf /')") == "'print('\"'\"'a; rm -rf /'\"'\"')'"
    out = subprocess.run(["bash", "-c", docker_line(script)], env={**env, "FAKE_DOCKER_PRINT": "1"},
                         capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == docker_argv(ls)
    assert json.loads(out.stdout)[-4:] == EVIL


def _run_script(script: str, env: dict, tmp_path: Path) -> subprocess.Popen:
    f = tmp_path / "user-data.sh"
    f.write_text(script)
    return subprocess.Popen(["bash", str(f)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_sigterm_to_the_script_stops_the_container_with_its_grace(provider, fakes, tmp_path):
    d, env = fakes
    ls = launch_spec(spec(command=EVIL), JOB, 3, 0, 2, "10.0.0.11", checkpoint_root=str(tmp_path / "ckpt"), grace_s=12)
    p = _run_script(cloud_init(ls, provider), env, tmp_path)
    try:
        _wait_for(d / "running")
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, out
    cs = calls(d)
    run = [c for c in cs if c["argv"][0] == "run"]
    assert [c["argv"] for c in run] == [docker_argv(ls)[1:]]
    assert run[0]["ifname"] == "ens5"  # computed at boot, passed through by the bare -e NCCL_SOCKET_IFNAME
    assert [c["argv"] for c in cs if c["argv"][0] == "stop"] == [["stop", "-t", "12", f"fedbroker-{JOB}-3-0"]]
    assert (tmp_path / "ckpt" / "ml" / JOB).is_dir()
    assert "received SIGTERM" in out


@pytest.mark.parametrize("provider,header", [("aws", "X-aws-ec2-metadata-token: tok"),
                                             ("gcp", "Metadata-Flavor: Google")])
def test_spot_notice_stops_the_container(provider, header, fakes, tmp_path):
    d, env = fakes
    ls = launch_spec(spec(), JOB, 1, 1, 2, "10.0.0.11", checkpoint_root=str(tmp_path / "ckpt"), grace_s=20)
    p = _run_script(cloud_init(ls, provider), {**env, "FAKE_NOTICE": "1"}, tmp_path)
    try:
        out, _ = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, out  # the fake container ends with 128 + SIGTERM
    assert [c["argv"] for c in calls(d) if c["argv"][0] == "stop"] == [["stop", "-t", "20", f"fedbroker-{JOB}-1-1"]]
    assert header in (d / "curl.log").read_text()
    assert "exited with status 143" in out


# ----------------------------------------------------------------------------- fedbroker nodes probe

def test_nodes_probe_with_the_fake_backend():
    from broker.cli.main import app

    r = CliRunner().invoke(app, ["nodes", "probe", "--nvml", "fake"])
    assert r.exit_code == 0, r.output
    assert "backend fake" in r.output and "4 GPU(s)" in r.output
    for i in range(4):
        assert f"GPU-00000000-fa4e-0000-0000-{i:012x}" in r.output
    assert r.output.count("Tesla V100-SXM2-16GB") == 4
    r = CliRunner().invoke(app, ["nodes", "probe", "--nvml", "fake", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["backend"], len(d["gpus"]), d["healthy_indices"]) == ("fake", 4, [0, 1, 2, 3])
    assert {"index", "uuid", "memory_total_mib", "utilisation_pct", "power_w", "energy_mj", "energy_j",
            "temperature_c", "mig_mode", "mig_instances", "ecc_uncorrected", "healthy", "error"} <= set(d["gpus"][0])


def test_nodes_probe_exits_2_without_nvml(monkeypatch):
    import providers.nvml as nv
    from broker.cli.main import app

    def unavailable(kind, **kw):
        raise nv.NvmlUnavailable("nvmlInit failed: NVML Shared Library Not Found")

    monkeypatch.setattr(nv, "open_backend", unavailable)
    r = CliRunner().invoke(app, ["nodes", "probe", "--nvml", "nvml"])
    assert r.exit_code == 2
    assert "NVML is not available" in r.output and "Shared Library Not Found" in r.output
    r = CliRunner().invoke(app, ["nodes", "probe", "--nvml", "bogus"])
    assert r.exit_code == 2 and "--nvml='bogus'" in r.output


def test_nodes_without_a_subcommand_still_lists_through_the_api():
    from broker.cli.main import app

    r = CliRunner().invoke(app, ["nodes", "--url", "http://127.0.0.1:1"])
    assert r.exit_code == 1 and "cannot reach the broker" in r.output
    r = CliRunner().invoke(app, ["nodes", "list", "--url", "http://127.0.0.1:1"])
    assert r.exit_code == 1 and "cannot reach the broker" in r.output


def test_cloud_init_options_are_checked_and_named():
    ls = ranks(spec())[0]
    ok = dict(report_url="http://10.0.0.2:8600/v1/instances/report", report_token="t" * 43)
    script = cloud_init(ls, "aws", checkpoint_uri="s3://ckpt-bucket/runs/ml/job-1", master_addr_at_boot=True, **ok)
    assert "REPORT_URL=http://10.0.0.2:8600/v1/instances/report" in script and f"REPORT_TOKEN={'t' * 43}" in script
    assert "CKPT_URI=s3://ckpt-bucket/runs/ml/job-1" in script
    assert "aws s3 sync --only-show-errors \"$CKPT_URI\" \"$CKPT_DIR\"" in script
    # rank 0's own address at boot: passed through, not a value
    line = shlex.split(docker_line(script))
    assert "MASTER_ADDR" in line and "PET_MASTER_ADDR" in line and not any(w.startswith("MASTER_ADDR=") for w in line)
    assert 'gcloud storage rsync --recursive --quiet "$CKPT_DIR" "$CKPT_URI"' in cloud_init(
        ls, "gcp", checkpoint_uri="gs://ckpt-bucket/runs", **ok)
    for kw, field in ((dict(report_url="http://x/'; reboot #", report_token="t" * 43), "report_url"),
                      (dict(report_url="http://x/r", report_token="short"), "report_token"),
                      (dict(report_url="http://x/r"), "report_url"),
                      (dict(checkpoint_uri="gs://ckpt-bucket/runs"), "checkpoint_uri"),  # gs:// on AWS
                      (dict(checkpoint_uri="s3://Bad_Bucket"), "checkpoint_uri"),
                      (dict(checkpoint_sync_s=1), "checkpoint_sync_s")):
        with pytest.raises(ValueError, match=field):
            cloud_init(ls, "aws", **kw)
