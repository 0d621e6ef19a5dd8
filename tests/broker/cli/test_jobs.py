"""The ``fedbroker`` job commands (broker.cli.jobs) with typer's CliRunner against a threaded API server."""

from __future__ import annotations

import json
import socket
import uuid

import pytest
from rich.console import Console
from typer.testing import CliRunner

from broker.cli import console as cli_console

from broker.cli import main as cli
from broker.service.api import create_app
from broker.model import Decision, DecisionKind, JobSpec, OptionEstimate
from broker.service.store.core import JobStore
from broker.service.tokens import create_token, principal_of
from tests.broker.harness import ServerThread, count_jobs


JOB_YAML = """\
name: resnet-nightly
image: ghcr.io/acme/resnet:2024.1
command: [python, train.py, --epochs, "90"]
gpus_per_node: 4
nodes: 2
gpu_types: [V100, A100]
estimated_duration_s: 7200
priority_class: low
deadline: 2099-01-01T00:00:00Z
"""


@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def server(store):
    with ServerThread(create_app(store)) as srv:
        yield srv


@pytest.fixture
def run(monkeypatch, server, store):
    """``run(*args, env=None) -> Result``: invoke ``fedbroker`` as a fresh team (``run.team``)."""
    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))
    team = "t" + uuid.uuid4().hex[:10]
    token = create_token(store, team).token
    runner = CliRunner()

    def invoke(*args, env: dict | None = None):
        return runner.invoke(cli.app, list(args), env={"FEDBROKER_API_URL": server.url, "FEDBROKER_TOKEN": token,
                                                        "FEDBROKER_CONFIG": None, **(env or {})})

    invoke.team = team
    return invoke


def test_submit_yaml_then_status_list_cancel(run, tmp_path, store):
    f = tmp_path / "job.yaml"
    f.write_text(JOB_YAML)
    r = run("submit", str(f), "--json")
    assert r.exit_code == 0, r.output
    job = json.loads(r.stdout)
    assert job["state"] == "submitted" and job["team"] == run.team and job["name"] == "resnet-nightly"
    assert job["spec"]["command"] == ["python", "train.py", "--epochs", "90"]
    assert (job["spec"]["gpus_per_node"], job["spec"]["nodes"], job["spec"]["gpu_types"]) == (4, 2, ["V100", "A100"])
    assert job["deadline"] == "2099-01-01T00:00:00Z"

    r = run("status", job["id"], "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["id"] == job["id"]
    r = run("status", job["id"])
    assert r.exit_code == 0, r.output
    assert "state: submitted" in r.stdout and "deadline: 2099-01-01T00:00:00Z" in r.stdout
    assert "gpus: 2 x 4 V100/A100" in r.stdout

    r = run("list", "--json")
    assert r.exit_code == 0 and [j["id"] for j in json.loads(r.stdout)] == [job["id"]]
    r = run("list")
    assert r.exit_code == 0 and job["id"] in r.stdout and "resnet-nightly" in r.stdout and "1 job(s)" in r.stdout

    r = run("cancel", job["id"], "--json")
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)
    assert c["state"] == "cancelled" and c["cancel_requested"] is True
    r = run("list", "--state", "cancelled", "--state", "failed", "--json")
    assert [j["id"] for j in json.loads(r.stdout)] == [job["id"]]
    assert json.loads(run("list", "--state", "submitted", "--json").stdout) == []
    assert count_jobs(store, run.team) == 1


def test_submit_with_idempotency_key_and_plain_output(run, tmp_path, store):
    f = tmp_path / "job.json"
    f.write_text(json.dumps({"command": ["true"], "gpus_per_node": 1, "estimated_duration_s": 60}))
    r1 = run("submit", str(f), "--idempotency-key", "k-1")
    r2 = run("submit", str(f), "--idempotency-key", "k-1")
    assert r1.exit_code == 0 and r2.exit_code == 0, r1.output + r2.output
    assert r1.stdout.split()[0] == r2.stdout.split()[0] and " submitted (team " in r1.stdout
    assert count_jobs(store, run.team) == 1


def test_submit_wait_times_out_with_exit_1(run, tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("command: [\"true\"]\ngpus_per_node: 1\n")
    r = run("submit", str(f), "--wait", "--timeout", "0.3", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["state"] == "submitted"  # no planner runs in this test
    assert "still submitted after 0.3 s" in r.output


@pytest.mark.parametrize("text, expected", [
    ("image: ghcr.io/acme/x:1\ngpus: 8\n", "gpus=8: unknown field"),
    ("gpus_per_node: -1\n", "gpus_per_node=-1: Input should be greater than or equal to 1"),
    ("image: 'busybox; rm -rf /'\n", "image='busybox; rm -rf /': not a valid image reference"),
    ("deadline: 2099-01-01T00:00:00\n", "deadline="),
    ("gpus_per_node: [4\n", "not valid YAML (line 2, column 1"),
    ("- just\n- a list\n", "must hold a mapping of job spec fields"),
])
def test_bad_job_file_exits_2_and_submits_nothing(run, tmp_path, store, text, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    r = run("submit", str(f))
    assert r.exit_code == 2, r.output
    assert str(f) in r.output and expected in r.output, r.output
    assert count_jobs(store, run.team) == 0


@pytest.mark.parametrize("name, text, expected", [
    ("dup.yaml", "command: [python, train.py]\ngpus_per_node: 1\ngpus_per_node: 4\n",
     "key 'gpus_per_node' appears twice (lines 2 and 3)"),
    ("dup.json", '{"command": ["true"], "gpus_per_node": 1, "gpus_per_node": 4}',
     "key 'gpus_per_node' appears twice in one object"),
])
def test_a_duplicate_key_in_a_job_file_exits_2_naming_it(run, tmp_path, store, name, text, expected):
    """Last-wins made a 4-GPU job of ``gpus_per_node: 1`` then ``4`` (issue #9)."""
    f = tmp_path / name
    f.write_text(text)
    r = run("submit", str(f))
    assert r.exit_code == 2, r.output
    assert f"{f}: {expected}" in r.output.replace("\n", ""), r.output
    assert count_jobs(store, run.team) == 0


def test_missing_file_exits_2(run, tmp_path):
    r = run("submit", str(tmp_path / "nope.yaml"))
    assert r.exit_code == 2 and "nope.yaml: cannot read" in r.output


def test_api_errors_exit_1(run):
    r = run("status", "job-" + "0" * 16)
    assert r.exit_code == 1 and "404 job_id='job-0000000000000000': no such job" in r.output
    r = run("list", "--team", "someone-else")
    assert r.exit_code == 1 and "403 team='someone-else'" in r.output
    r = run("status", "job-" + "0" * 16, "--token", "fbk_wrong")
    assert r.exit_code == 1 and "401 unknown or revoked token" in r.output
    r = run("list", "--state", "bogus")
    assert r.exit_code == 2 and "--state='bogus': not a job state" in r.output


def test_unreachable_broker_exits_1(run):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    r = run("status", "job-" + "0" * 16, "--url", url)
    assert r.exit_code == 1
    out = " ".join(r.output.split())
    assert f"cannot reach the broker at {url} (" in out and "; is `fedbroker serve` running there?" in out
    assert out.count("cannot reach the broker") == 1  # once: the CLI no longer repeats the SDK's message


def test_explain_and_logs(run, store):
    j, _ = store.submit(run.team, JobSpec(command=["true"], gpus_per_node=8))
    chosen = OptionEstimate("onprem", "toronto", 1.7e9, 0.0, 3600.0, 2.85, 3.12, 0.094, 2.87)
    alt = OptionEstimate("cloud", "aws:us-east-1a:p3.16xlarge:spot", 1.7e9, 300.0, 3600.0, 7.34, 2.6, 1.01, 7.53)
    rec = Decision(j.id, DecisionKind.start, chosen, pool="toronto", alternatives=(alt,), reason="cheapest").record()
    rec["signals"] = [{"zone": "CA-ON", "kind": "carbon", "source": "last-known:electricitymaps", "fallback": True,
                       "note": "carbon CA-ON: no fresh value from electricitymaps; deciding on electricitymaps's last "
                               "known value (forecast, 2.0 h old)"}]
    store.transition(j.id, "queued", "planned", decision=rec)
    store.transition(j.id, "starting", "dispatched", attempt=1)
    store.append_log(j.id, 1, 0, 0, "step 1\n")
    store.append_log(j.id, 1, 0, 1, "step 2\n")
    r = run("explain", j.id)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "decision: start - cheapest" in out
    chosen_line = next(line for line in out.splitlines() if "chosen" in line and "toronto" in line)
    assert "toronto" in chosen_line and "$2.85" in chosen_line and "3.12" in chosen_line and "0.094" in chosen_line
    alt_line = next(line for line in out.splitlines() if "p3.16xlarge" in line)
    assert "$7.34" in alt_line and "1.010" in alt_line and "5.0 min" in alt_line
    assert ("signals: FALLBACK carbon CA-ON: no fresh value from electricitymaps; deciding on electricitymaps's last "
            "known value (forecast, 2.0 h old)") in out
    assert "submitted" in out and "dispatched" in out  # the history
    ex = json.loads(run("explain", j.id, "--json").stdout)
    assert ex["decision"]["option"]["target"] == "toronto"
    r = run("logs", j.id)
    assert r.exit_code == 0 and r.stdout == "step 1\nstep 2\n"
    r = run("logs", j.id, "--rank", "1")  # a rank with nothing yet says so, on stderr
    assert r.exit_code == 0 and r.stdout == "" and f"{j.id}: attempt 1 rank 1 has no log yet" in r.stderr
    # a job's escape sequences never reach the reader's terminal unless --raw (found by a hostile review: the
    # OSC that sets the window title and a clear-screen went through to an admin's terminal)
    store.append_log(j.id, 1, 0, 2, "\x1b]0;PWNED\x07\x1b[2J10%\r20%\tok\r\n")
    r = run("logs", j.id)
    assert r.stdout == "step 1\nstep 2\n\\x1b]0;PWNED\\x07\\x1b[2J10%\n20%\tok\n"
    assert run("logs", j.id, "--raw").stdout_bytes == b"step 1\nstep 2\n\x1b]0;PWNED\x07\x1b[2J10%\r20%\tok\r\n"


def test_tokens_create(tmp_path):
    db = tmp_path / "fb.db"
    r = CliRunner().invoke(cli.app, ["tokens", "create", "--team", "vision", "--label", "ci"],
                           env={"FEDBROKER_DATABASE_URL": f"sqlite:///{db}", "FEDBROKER_CONFIG": None})
    assert r.exit_code == 0, r.output
    token = r.stdout.strip()
    assert token.startswith("fbk_")
    st = JobStore(f"sqlite:///{db}")
    p = principal_of(st, token)
    assert p is not None and (p.team, p.admin) == ("vision", False)
    st.engine.dispose()
    r = CliRunner().invoke(cli.app, ["tokens", "create", "--team", "bad team!"],
                           env={"FEDBROKER_DATABASE_URL": f"sqlite:///{db}", "FEDBROKER_CONFIG": None})
    assert r.exit_code == 2 and "team='bad team!'" in r.output


@pytest.mark.parametrize("args, env, message", [
    (["list", "--url", "notaurl", "--token", "abc"], {}, "error: --url='notaurl': not an http:// or https:// URL"),
    (["list", "--url", "http://127.0.0.1:9"], {"FEDBROKER_TOKEN": "t\u00e9"},
     "error: --token (or FEDBROKER_TOKEN): not a fedbroker API token"),
])
def test_bad_url_or_token_exits_2_with_a_message(args, env, message):
    r = CliRunner().invoke(cli.app, args, env=env)
    assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.parametrize("content, message", [
    (b"name: \xff\ncommand: [echo]\n", "not UTF-8 text (byte 0xff at offset 6)"),
    (b"command: [echo]\nestimated_duration_s: .inf\n", "estimated_duration_s=inf: Input should be a finite number"),
    (b"#" * (2 * 1024 * 1024 + 1), "larger than 2097152 bytes (the API's request limit)"),  # /dev/zero grew for ever
])
def test_unreadable_or_non_finite_job_file_exits_2(tmp_path, content, message):
    f = tmp_path / "job.yaml"
    f.write_bytes(content)
    r = CliRunner().invoke(cli.app, ["submit", str(f), "--url", "http://127.0.0.1:9", "--token", "abc"])
    assert r.exit_code == 2 and message in r.output, r.output


def test_tokens_bootstrap_rule_direct_database(tmp_path):
    """Without --token, `tokens create` writes to the store only while it has no admin token (a fresh install)."""
    env = {"FEDBROKER_DATABASE_URL": f"sqlite:///{tmp_path / 'fb.db'}", "FEDBROKER_CONFIG": None, "FEDBROKER_TOKEN": None}

    def create(*args):
        return CliRunner().invoke(cli.app, ["tokens", "create", *args], env=env)

    member = create("--team", "vision")  # the README's one-machine flow, on a fresh store
    assert member.exit_code == 0, member.output
    admin = create("--team", "ops", "--admin", "--ttl", "30d", "--label", "root")
    assert admin.exit_code == 0, admin.output
    st = JobStore(f"sqlite:///{tmp_path / 'fb.db'}")
    p = principal_of(st, admin.stdout.strip())
    assert (p.kind, p.team) == ("admin", "ops")
    assert principal_of(st, member.stdout.strip()).kind == "member"
    st.engine.dispose()
    assert "admin token tok-" in admin.stderr and "for team 'ops', expires " in admin.stderr
    for args in (("--team", "ops", "--admin"), ("--team", "vision")):
        r = create(*args)
        assert r.exit_code == 1 and r.stdout == ""
        assert "this store already has an admin token" in r.stderr and "--token" in r.stderr
    r = create("--team", "vision", "--ttl", "10y")
    assert r.exit_code == 2 and "--ttl='10y': a lifetime such as 30d" in r.stderr
    r = create("--team", "vision", "--kind", "root")
    assert r.exit_code == 2 and "--kind='root': one of member, team-admin, read-only, node, admin" in r.stderr


def test_tokens_over_the_api(server, store):
    team = "t" + uuid.uuid4().hex[:10]
    admin = create_token(store, "ops", "admin").token
    runner = CliRunner()

    def run(*args, token=admin):
        return runner.invoke(cli.app, list(args), env={"FEDBROKER_API_URL": server.url, "FEDBROKER_TOKEN": token,
                                                       "FEDBROKER_CONFIG": None})

    r = run("tokens", "create", "--team", team, "--kind", "read-only", "--ttl", "7d", "--label", "finance", "--json")
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout)
    assert (made["team"], made["kind"], made["label"]) == (team, "read-only", "finance")
    r = run("tokens", "list", "--team", team)
    assert r.exit_code == 0 and made["id"] in r.stdout and "read-only" in r.stdout and "active" in r.stdout
    r = run("tokens", "rotate", made["id"])
    assert r.exit_code == 0, r.output
    new_secret = r.stdout.strip()
    assert new_secret.startswith("fbk_") and f"replaces {made['id']} (now revoked)" in r.stderr
    new = principal_of(store, new_secret)
    assert (new.kind, new.team) == ("read-only", team) and principal_of(store, made["token"]) is None
    r = run("tokens", "revoke", new.token_id)
    assert r.exit_code == 0 and r.stdout.strip() == f"{new.token_id} revoked (read-only of {team})"
    assert principal_of(store, new_secret) is None
    r = run("audit", "--action", "token.revoke", "--limit", "1", "--json")
    assert r.exit_code == 0
    [ev] = json.loads(r.stdout)
    assert (ev["action"], ev["target"], ev["actor_kind"], ev["actor_team"]) == ("token.revoke", new.token_id, "admin", "ops")
    # a member token may not manage tokens: the API's 403, exit 1
    member = create_token(store, team).token
    r = run("tokens", "list", token=member)
    assert r.exit_code == 1 and "403 a member token cannot manage tokens" in r.stderr
    r = run("tokens", "create", "--team", team, token=member)
    assert r.exit_code == 1 and "403" in r.stderr


@pytest.mark.parametrize("cmd,job_id", [("cancel", "../tokens/tok-0123456789abcdef/revoke?"), ("status", "../tokens?x="),
                                        ("logs", "../../healthz?"), ("explain", "%2e%2e")])
def test_a_hostile_job_id_is_a_clean_usage_error(run, store, cmd, job_id):
    """Issue #9: the id went unescaped into the URL (``cancel ../tokens/<id>/revoke?`` revoked a token)."""
    victim = create_token(store, run.team)
    r = run(cmd, job_id.replace("tok-0123456789abcdef", victim.id))
    assert r.exit_code == 2, r.output
    shown = job_id.replace("tok-0123456789abcdef", victim.id)
    assert r.output.strip() == f"error: job_id={shown!r}: not a job id (expected job-[0-9a-f]{{16}})"
    assert principal_of(store, victim.token) is not None  # still valid


def test_submit_wait_prints_each_change_of_state_as_it_happens(run, tmp_path, store):
    """Issue #20 (finding 8d): ``submit --wait`` printed "waiting ..." and nothing else however long the job took.
    A thread here moves the job through its states in the store as the planner and an agent would; every
    change is printed with its reason, in order (on cb5ea98 none of these lines is printed)."""
    import threading
    import time

    from sqlalchemy import select

    from broker.service.store.tables import Job

    f = tmp_path / "job.yaml"
    f.write_text('command: ["true"]\ngpus_per_node: 1\nestimated_duration_s: 60\n')
    moves = [("queued", "accepted"), ("starting", "placed on pool local: n1 GPUs [0] (attempt 1)"),
             ("running", "running on n1"), ("succeeded", "exit code 0")]

    def drive():
        end = time.monotonic() + 20
        jid = None
        while jid is None and time.monotonic() < end:
            with store.session() as s:
                jid = s.execute(select(Job.id).where(Job.team == run.team)).scalar_one_or_none()
            time.sleep(0.05)
        for state, why in moves:
            time.sleep(0.6)  # more than the SDK's 0.5 s poll: each state is seen (the lines come from the events anyway)
            assert store.transition(jid, state, why)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    r = run("submit", str(f), "--wait", "--timeout", "60")
    t.join(timeout=30)
    assert r.exit_code == 0, r.output
    lines = [ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("20")]  # each after its UTC time
    assert lines == ["- -> submitted: submitted", "submitted -> queued: accepted",
                     "queued -> starting: placed on pool local: n1 GPUs [0] (attempt 1)",
                     "starting -> running: running on n1", "running -> succeeded: exit code 0"], r.stdout
    assert "state: succeeded" in r.stdout
