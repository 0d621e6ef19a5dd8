"""``fedbroker serve api``'s server (broker.service.httpserver): slow clients cannot hold it, TLS, and its settings."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from broker.service.api import create_app
from broker.service.httpserver import MAX_HEADER_BYTES, GuardedH11Protocol, GuardedHttpToolsProtocol, server_config
from broker.service.settings import BrokerSettings, SettingsError, load_settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FastH11(GuardedH11Protocol):
    header_timeout_s = 1.0
    body_timeout_s = 1.0


class _FastHttpTools(GuardedHttpToolsProtocol):
    header_timeout_s = 1.0
    body_timeout_s = 1.0


@pytest.fixture(params=[_FastHttpTools, _FastH11], ids=["httptools", "h11"])
def proto(request):
    """Both guarded protocols, with 1 s read timeouts (10 s and 30 s in serve api)."""
    return request.param


def _serve(app, settings, protocol=None):
    """A uvicorn server of ``app`` in a thread, listening when this returns; stop it with ``.should_exit = True``."""
    import uvicorn

    cfg = server_config(app, settings, log_level="warning")
    if protocol is not None:
        cfg.http = protocol
    server = uvicorn.Server(cfg)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "the server did not start"
        time.sleep(0.02)
    return server, t


@pytest.fixture
def app(sqlite_store):
    return create_app(sqlite_store)


def test_200_partial_header_connections_do_not_block_a_request_and_are_closed(app, tmp_path, proto):
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path), protocol=proto)
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
            socks.append(s)
        t0 = time.monotonic()
        r = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        # past the header timeout (1 s here, 10 s in serve api) every slow connection is closed by the server;
        # a trickle does not extend it
        time.sleep(0.6)
        for s in socks[:20]:
            s.sendall(b"a")
        closed = 0
        deadline = time.monotonic() + 3.0
        for s in socks:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                closed += 0
        assert closed == 200
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        t.join(15)


def test_a_body_that_stops_arriving_is_cut_after_the_body_timeout(app, tmp_path, proto):
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path), protocol=proto)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"spec\": ")
        t0 = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        assert 0.8 < time.monotonic() - t0 < 3.0
        s.close()
    finally:
        server.should_exit = True
        t.join(15)


def test_a_keep_alive_connection_serves_two_requests(app, tmp_path, proto):
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path), protocol=proto)
    try:
        with requests.Session() as sess:
            assert sess.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
            assert sess.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        server.should_exit = True
        t.join(15)


def test_a_request_head_over_the_limit_is_400(app, tmp_path):
    """httptools (serve api's parser): counted in the parser callbacks. (h11's ``max_incomplete_event_size``
    only bounds a head still incomplete in its buffer: one that arrives whole in one read is taken.)"""
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path), protocol=_FastHttpTools)
    try:
        r = requests.get(f"http://127.0.0.1:{port}/healthz", headers={"X-Big": "x" * (MAX_HEADER_BYTES + 1)}, timeout=5)
        assert r.status_code == 400
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        server.should_exit = True
        t.join(15)


def test_a_slow_request_after_a_keep_alive_pause_is_cut_too(app, tmp_path, proto):
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path), protocol=proto)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 200 " in s.recv(4096).split(b"\r\n", 1)[0]
        s.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # the next request never finishes its headers
        t0 = time.monotonic()
        while s.recv(4096):
            pass
        assert 0.8 < time.monotonic() - t0 < 3.0
        s.close()
    finally:
        server.should_exit = True
        t.join(15)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_with_certfile_and_keyfile(app, tmp_path):
    cert, key = _self_signed(tmp_path)
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_certfile=cert, api_keyfile=key))
    try:
        r = requests.get(f"https://127.0.0.1:{port}/healthz", timeout=5, verify=str(cert))
        assert r.status_code == 200 and r.json()["database"] == "ok"
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        server.should_exit = True
        t.join(15)


def test_server_config_limits_and_tls_errors(app, tmp_path):
    cfg = server_config(app, BrokerSettings(state_dir=tmp_path, api_max_connections=50))
    assert (cfg.limit_concurrency, cfg.timeout_keep_alive, cfg.h11_max_incomplete_event_size) == (50, 5, 16384)
    assert cfg.http is GuardedHttpToolsProtocol and cfg.ssl_certfile is None
    with pytest.raises(ValueError, match=r"api_certfile='/x.pem', api_keyfile=None: give both \(TLS\) or neither"):
        server_config(app, BrokerSettings(state_dir=tmp_path, api_certfile="/x.pem"))
    with pytest.raises(ValueError, match=r"api_certfile='/nope/c.pem': no such file"):
        server_config(app, BrokerSettings(state_dir=tmp_path, api_certfile="/nope/c.pem", api_keyfile="/nope/k.pem"))


@pytest.mark.parametrize("url, ok", [
    ("https://broker.internal:8600/v1/instances/report", True),
    ("http://127.0.0.1:8600/v1/instances/report", True),
    ("http://localhost:8600/r", True),
    ("http://[::1]:8600/r", True),
    ("http://10.0.0.2:8600/v1/instances/report", False),
    ("http://broker.internal/r", False),
    ("ftp://broker.internal/r", False),
])
def test_report_url_must_be_https_unless_loopback(url, ok, tmp_path):
    if ok:
        assert load_settings(state_dir=tmp_path, cloud={"report_url": url}).cloud.report_url == url
    else:
        with pytest.raises(SettingsError) as e:
            load_settings(state_dir=tmp_path, cloud={"report_url": url})
        assert str(e.value).startswith(f"setting cloud.report_url={url!r}: must be an https:// URL"), str(e.value)
