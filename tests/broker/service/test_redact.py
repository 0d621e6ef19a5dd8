"""Secrets never reach a log: broker.service.redact, and the real ``fedbroker serve api`` / ``serve worker`` processes run with
passwords in ``database_url`` and ``redis_url`` and an ``admin_token``, their whole output grepped."""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as hs

from broker.service.redact import SecretFilter, install_secret_filter, mask_url, settings_secrets
from broker.service.settings import BrokerSettings
from tests.conftest import PG_URL, REDIS_URL

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("url, masked", [
    ("postgresql+psycopg://broker:S3cr%40t@db:5432/fb", "postgresql+psycopg://broker:***@db:5432/fb"),
    ("redis://:pw123@redis:6379/0", "redis://:***@redis:6379/0"),
    ("rediss://default:pw123@redis:6380/1", "rediss://default:***@redis:6380/1"),
    ("redis://redis:6379/0", "redis://redis:6379/0"),
    ("sqlite:////var/lib/fedbroker/fb.db", "sqlite:////var/lib/fedbroker/fb.db"),
    ("postgresql://u@h/db?password=abc&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
    ("https://user@broker.example/v1", "https://user@broker.example/v1"),
    (None, ""),
])
def test_mask_url(url, masked):
    assert mask_url(url) == masked


_PW = hs.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~%!$&'()+,;=",
               min_size=1, max_size=40).map(lambda p: "Pw" + p)


@given(pw=_PW, user=hs.sampled_from(["", "broker", "postgres"]),
       scheme=hs.sampled_from(["postgresql+psycopg", "redis", "rediss", "https"]),
       tail=hs.sampled_from(["/0", "/fedbroker", "/db?sslmode=require", ""]))
def test_mask_url_never_shows_the_password(pw, user, scheme, tail):
    url = f"{scheme}://{user}:{pw}@host.example:5432{tail}"
    masked = mask_url(url)
    assert masked == f"{scheme}://{user}:***@host.example:5432{tail}"
    assert pw not in masked


@given(secret=hs.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=4, max_size=30),
       before=hs.text(max_size=30), after=hs.text(max_size=30), as_arg=hs.booleans())
def test_secret_filter_masks_any_message(secret, before, after, as_arg):
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "%s" if as_arg else before + secret + after,
                               (before + secret + after,) if as_arg else (), None)
    assert SecretFilter([secret]).filter(record) is True
    assert secret not in record.getMessage()
    assert record.getMessage().count("***") >= 1


def test_settings_secrets_and_filter():
    st = BrokerSettings.model_construct(database_url="postgresql+psycopg://b:Pg%2Fpw99@db/fb",
                                        redis_url="redis://:RedisPw99@r:6379/0", admin_token="adm-token-99")
    assert set(settings_secrets(st)) == {"Pg%2Fpw99", "Pg/pw99", "RedisPw99", "adm-token-99"}
    log = logging.getLogger(f"t{uuid.uuid4().hex}")
    log.propagate = False
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(h)
    install_secret_filter(st, log)
    install_secret_filter(st, log)  # idempotent: one filter per handler
    assert sum(isinstance(f, SecretFilter) for f in h.filters) == 1
    log.warning("connecting to %s with %s", st.database_url, {"redis": st.redis_url})
    try:
        raise RuntimeError(f"auth failed for adm-token-99 on {st.redis_url}")
    except RuntimeError:
        log.exception("boom Pg/pw99")
    out = buf.getvalue()
    for secret in ("Pg%2Fpw99", "Pg/pw99", "RedisPw99", "adm-token-99"):
        assert secret not in out
    assert out.splitlines()[0] == "WARNING connecting to postgresql+psycopg://b:***@db/fb with {'redis': 'redis://:***@r:6379/0'}"
    assert "RuntimeError: auth failed for *** on redis://:***@r:6379/0" in out and "ERROR boom ***" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_password(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    rest = rest.split("@", 1)[-1]
    return f"{scheme}://{user}:{password}@{rest}"


def test_serve_api_and_worker_never_log_secrets(tmp_path):
    """PostgreSQL here trusts local connections and Redis takes any password, so the secrets are real
    settings the processes use, not placeholders that fail early."""
    db_pw, redis_pw, admin = "DbPw" + uuid.uuid4().hex[:8], "RdPw" + uuid.uuid4().hex[:8], "Adm" + uuid.uuid4().hex
    schema = f"t_{uuid.uuid4().hex[:12]}"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDBROKER_CONFIG": "",
           "FEDBROKER_DATABASE_URL": _with_password(PG_URL, "postgres", db_pw), "FEDBROKER_DATABASE_SCHEMA": schema,
           "FEDBROKER_REDIS_URL": _with_password(REDIS_URL, "", redis_pw), "FEDBROKER_ADMIN_TOKEN": admin,
           "FEDBROKER_API_PORT": str(port), "FEDBROKER_STATE_DIR": str(tmp_path / "state")}
    env.pop("FEDBROKER_CONFIG")
    from broker.service.store.core import JobStore

    JobStore(PG_URL, schema=schema).migrate()  # as `serve all` does: two processes migrating one fresh schema race
    logs = {k: open(tmp_path / f"{k}.log", "w+") for k in ("api", "worker")}
    procs = {k: subprocess.Popen([sys.executable, "-m", "broker.cli.main", "serve", k], cwd=tmp_path, env=env,
                                 stdout=logs[k], stderr=subprocess.STDOUT) for k in logs}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert procs["api"].poll() is None, (tmp_path / "api.log").read_text()
            try:
                if requests.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the API did not start"
            time.sleep(0.3)
        h = {"Authorization": f"Bearer {admin}"}
        r = requests.post(f"{url}/v1/jobs", json={"spec": {"command": ["true"]}}, headers=h, timeout=10)
        assert r.status_code == 201, r.text
        r = requests.post(f"{url}/v1/tokens", json={"team": "vision"}, headers=h, timeout=10)
        assert r.status_code == 201
        deadline = time.monotonic() + 60
        while "[queues]" not in (tmp_path / "worker.log").read_text() and time.monotonic() < deadline:
            assert procs["worker"].poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(0.3)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
        JobStore(PG_URL, schema=schema).drop_schema()
    api_log, worker_log = (tmp_path / "api.log").read_text(), (tmp_path / "worker.log").read_text()
    for name, text in (("api", api_log), ("worker", worker_log)):
        for secret in (db_pw, redis_pw, admin):
            assert secret not in text, f"{name} log shows a secret:\n{text}"
    assert f"database postgresql+psycopg://postgres:***@" in api_log  # the URL is logged, masked
    assert "settings.admin_token is deprecated" in api_log
    assert "transport:   redis://:**@" in worker_log and "[queues]" in worker_log  # Celery's banner, masked


@pytest.mark.parametrize("name, secret", [
    ("api_key", True), ("electricitymaps_api_key", True), ("admin_token", True), ("password", True),
    ("sslpassword", True), ("passwd", True), ("client_secret", True), ("jwt", True), ("credentials", True),
    ("jwt_file", False), ("secrets_file", False), ("api_key_env", False), ("region", False), ("rest_url", False),
    (0, False), (None, False),
])
def test_one_rule_for_a_secret_name(name, secret):
    from broker.service.redact import is_secret_name

    assert is_secret_name(name) is secret


def test_hide_secret_values_and_mask_userinfo():
    from broker.service.redact import hide_secret_values, mask_userinfo

    assert hide_secret_values({"a": 1, "api_key": "K", "x": [{"token": "T", "u": "ftp://u:p@h"}]}) == \
        {"a": 1, "api_key": "<hidden>", "x": [{"token": "<hidden>", "u": "ftp://u:***@h"}]}
    assert hide_secret_values("K", "api_key") == "<hidden>"
    assert mask_userinfo("rest_url='ftp://user:pa55w0rd@[::1': bad; http://h/a@b, https://ann@h") == \
        "rest_url='ftp://user:***@[::1': bad; http://h/a@b, https://ann@h"
