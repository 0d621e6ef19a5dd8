"""``fedbroker serve``: quiet logs, no beat-schedule files, a clean SIGTERM, the API first (issue #9, item 8)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from broker.cli.serve import _celery_level, _logging, _settings
from broker.service.settings import BrokerSettings
from tests.conftest import REDIS_URL, auth

ROOT = Path(__file__).resolve().parents[3]
REDIS_PORT = urlsplit(REDIS_URL).port or 6379


def test_celery_logs_at_warning_unless_debug():
    assert [_celery_level(x) for x in ("info", "INFO", "warning", "error", "debug")] == [
        "WARNING", "WARNING", "WARNING", "ERROR", "DEBUG"]
    try:
        _logging("info")
        assert logging.getLogger("celery.app.trace").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("celery.beat").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("alembic.runtime.migration").getEffectiveLevel() == logging.WARNING  # 7 lines a start
        _logging("debug")
        assert logging.getLogger("celery.beat").getEffectiveLevel() == logging.DEBUG
    finally:
        for name in ("celery", "kombu", "alembic"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_serve_all_is_quiet_leaves_no_beat_files_and_stops_cleanly_on_sigterm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = tmp_path / "state"
    state.mkdir()
    (state / "beat-schedule-123.dat").write_text("left by an older version")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"redis_url: {REDIS_URL}\nstate_dir: {state}\napi_port: {port}\nplan_interval_s: 1\n")
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER_")}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "broker.cli.main", "serve", "all", "--trial", "--config", str(cfg)],
                         cwd=tmp_path, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    try:
        while True:
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < 90, log.read_text()[-3000:]
            try:
                r = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                if r.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        # the test Redis has no password: a trial, said in /healthz (and in the WARNING block at start)
        assert r.json() == {"status": "ok", "database": "ok", "redis": "ok", "trial": (
            f"trial mode: redis_url (redis at 127.0.0.1:{REDIS_PORT}); a job that reaches one can stop planning for "
            "every team or read the job store. For a single user on one machine only")}
        assert "WARNING: fedbroker is running in TRIAL mode (serve all --trial)" in log.read_text()
        # the worker, beat and agent start after the API (the worker's Celery banner, the agent's start line);
        # then it idles (a plan every second, the agent polling the node API twice a second)
        while "[queues]" not in (text := log.read_text(errors="replace")) or " polling http" not in text:
            assert time.monotonic() - t0 < 120 and p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "superuser privileges" not in text  # run as root here, as the README's recipe: no Celery warning
        time.sleep(3)
        before = log.stat().st_size
        time.sleep(6)
        idle = log.read_bytes()[before:]
        assert idle == b"", idle.decode(errors="replace")[-2000:]
        assert not list(state.glob("beat-schedule-*"))
        t1 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert time.monotonic() - t1 < 20
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log.read_text(errors="replace")
    assert "Sending due task" not in text and "succeeded in" not in text


def test_serve_warns_about_a_settings_file_other_users_can_read(tmp_path, caplog):
    from broker.cli.serve import _settings

    cfg = tmp_path / "fb.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\n")
    os.chmod(cfg, 0o644)
    with caplog.at_level(logging.WARNING, logger="fedbroker.serve"):
        _settings(cfg)
    assert [r.getMessage() for r in caplog.records if r.name == "fedbroker.serve"] == [
        f"settings file {cfg} is mode 0644, readable by other users; `chmod 600` it (it holds the database and "
        "Redis URLs)"]
    caplog.clear()
    os.chmod(cfg, 0o600)
    with caplog.at_level(logging.WARNING, logger="fedbroker.serve"):
        _settings(cfg)
    assert [r for r in caplog.records if r.name == "fedbroker.serve"] == []


# ----------------------------------------------------------------------------- the composition root (#10)
@pytest.fixture
def api_config(tmp_path, monkeypatch):
    """A settings file for an API process on an SQLite store in ``tmp_path`` and the test Redis; no other
    ``FEDBROKER_*`` variable in the environment."""
    for k in [k for k in os.environ if k.startswith("FEDBROKER_")]:
        monkeypatch.delenv(k)
    cfg = tmp_path / "fb.yaml"
    cfg.write_text(f"database_url: sqlite:///{tmp_path / 'fb.db'}\nredis_url: {REDIS_URL}\nstate_dir: {tmp_path}\n")
    os.chmod(cfg, 0o600)
    monkeypatch.setenv("FEDBROKER_CONFIG", str(cfg))
    return cfg


def _submit_kicks(app, database_url: str, monkeypatch) -> list[str]:
    """Submit one job to ``app``; the planner kicks that followed (``wiring.kick_planner`` recorded)."""
    from broker.service import wiring
    from broker.service.store.core import JobStore
    from broker.service.tokens import create_token

    kicks: list[str] = []
    monkeypatch.setattr(wiring, "kick_planner", lambda debounce_ms=200: kicks.append("plan") or True)
    token = create_token(JobStore(database_url), "vision", label="test").token
    with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    with TestClient(app) as c:
        r = c.post("/v1/jobs", json={"spec": {"command": ["true"], "estimated_duration_s": 600}}, headers=auth(token))
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 5  # the kick comes from the API's wake-up thread (wiring.PlannerWake)
    while not kicks and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # and no second one follows
    return kicks


def test_an_api_process_built_by_app_from_settings_kicks_the_planner_on_submit(api_config, tmp_path, monkeypatch):
    from broker.service.wiring import app_from_settings

    app = app_from_settings()  # the uvicorn factory: it migrates the fresh SQLite store itself
    assert _submit_kicks(app, f"sqlite:///{tmp_path / 'fb.db'}", monkeypatch) == ["plan"]


def test_an_api_process_of_serve_api_kicks_the_planner_on_submit(api_config, tmp_path, monkeypatch):
    from broker.cli.serve import _migrate, api_app  # api_app: the factory of each `serve api --workers N` process

    _migrate(_settings(api_config))
    assert _submit_kicks(api_app(), f"sqlite:///{tmp_path / 'fb.db'}", monkeypatch) == ["plan"]


class _Sent:
    """Records ``send_task`` calls instead of queueing them on a Celery broker."""

    def __init__(self):
        self.calls: list[tuple[str, list, str]] = []

    def send_task(self, name, args=None, queue=None, **kw):
        self.calls.append((name, args, queue))


def test_a_cloud_placement_goes_straight_to_the_provisioning_queue(monkeypatch):
    from broker.service import wiring
    from broker.service.settings import BrokerSettings

    sent = _Sent()
    monkeypatch.setattr(wiring, "get_app", lambda settings=None: sent)
    svc = wiring.Services()
    svc.__dict__.update(settings=BrokerSettings(), store=object(), env=object(), cloud=None)
    assert svc.cycle.dispatch is wiring.send_provision and svc.reconciler.dispatch is wiring.send_provision
    svc.cycle.dispatch("job-00000000000000aa", 3)
    wiring.send_teardown("job-00000000000000aa", 3)
    assert sent.calls == [("fedbroker.provision", ["job-00000000000000aa", 3], "provisioning"),
                          ("fedbroker.teardown", ["job-00000000000000aa", 3], "provisioning")]


def test_the_dispatch_relay_stays_registered_for_messages_already_queued():
    from broker.service.celery_app import make_celery
    from broker.service.settings import BrokerSettings

    app = make_celery(BrokerSettings())
    app.loader.import_default_modules()
    assert {"fedbroker.plan", "fedbroker.reconcile", "fedbroker.provision", "fedbroker.teardown",
            "fedbroker.dispatch"} <= set(app.tasks)
    assert app.conf.task_routes["fedbroker.dispatch"] == {"queue": "dispatch"}


def test_serve_all_refuses_a_passwordless_redis_without_trial(tmp_path):
    """Issue 20 finding #2: on cb5ea98 ``serve all`` started a root agent running other people's jobs next to a
    password-less Redis and said nothing. Now it exits 2 naming the setting and the way out, starting nothing."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"redis_url: {REDIS_URL}\nstate_dir: {tmp_path / 'state'}\n"
                   "database_url: postgresql+psycopg://postgres@127.0.0.1:5432/test\n")
    os.chmod(cfg, 0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER_")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-m", "broker.cli.main", "serve", "all", "--config", str(cfg)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: serve all: no password in redis_url (redis at 127.0.0.1:{REDIS_PORT}); "
                               "database_url (postgresql at 127.0.0.1:5432). "), p.stderr
    assert "or pass --trial for a single-user trial on this machine" in p.stderr
    assert not (tmp_path / "state").exists()  # nothing was started (not even the store migrated)


def test_trial_notice_and_passwordless():
    from broker.service.service_endpoints import passwordless, trial_notice

    assert trial_notice(BrokerSettings()) is None
    with_pw = BrokerSettings(redis_url="redis://:pw@127.0.0.1:6379/0", trial=True)
    assert passwordless(with_pw) == []
    assert trial_notice(with_pw).startswith("trial mode: no password-less service;")
