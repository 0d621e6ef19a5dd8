"""``fedbroker serve``: quiet logs, no beat-schedule files, a clean SIGTERM, the API first (issue #9, item 8)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from broker.cli.serve import _celery_level, _logging
from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


def test_celery_logs_at_warning_unless_debug():
    assert [_celery_level(x) for x in ("info", "INFO", "warning", "error", "debug")] == [
        "WARNING", "WARNING", "WARNING", "ERROR", "DEBUG"]
    try:
        _logging("info")
        assert logging.getLogger("celery.app.trace").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("celery.beat").getEffectiveLevel() == logging.WARNING
        _logging("debug")
        assert logging.getLogger("celery.beat").getEffectiveLevel() == logging.DEBUG
    finally:
        for name in ("celery", "kombu"):
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
    p = subprocess.Popen([sys.executable, "-m", "broker.cli.main", "serve", "all", "--config", str(cfg)], cwd=tmp_path,
                         env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
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
        assert r.json() == {"status": "ok", "database": "ok", "redis": "ok"}
        # the worker, beat and agent start after the API (the worker's Celery banner, the agent's start line);
        # then it idles (a plan every second, the agent polling the node API twice a second)
        while "[queues]" not in (text := log.read_text(errors="replace")) or " polling http" not in text:
            assert time.monotonic() - t0 < 120 and p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
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
