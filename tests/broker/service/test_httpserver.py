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
    # all 200 from one address: no per-address cap here (it has tests of its own below)
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections_per_peer=0),
                       protocol=proto)
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
        # Connection: close, else a reference to the response keeps its TLS connection open, and the server's
        # stop waits for it (its graceful-shutdown timeout, 10 s)
        r = requests.get(f"https://127.0.0.1:{port}/healthz", timeout=5, verify=str(cert), headers={"Connection": "close"})
        assert r.status_code == 200 and r.json()["database"] == "ok"
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        server.should_exit = True
        t.join(15)


def test_server_config_limits_and_tls_errors(app, tmp_path):
    cfg = server_config(app, BrokerSettings(state_dir=tmp_path, api_max_connections=50))
    assert (cfg.limit_concurrency, cfg.timeout_keep_alive, cfg.h11_max_incomplete_event_size) == (50, 5, 16384)
    assert cfg.http is GuardedHttpToolsProtocol and cfg.ssl_certfile is None and cfg.ws == "none"
    assert cfg.fedbroker_max_connections_per_peer == 50  # the default 64, lowered to the process cap
    assert server_config(app, BrokerSettings(state_dir=tmp_path)).fedbroker_max_connections_per_peer == 64
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


# ---------------------------------------------------------------------- per-address connection cap


class _CountingApp:
    """A bare ASGI app: 200 ``ok`` to every request, counting the requests that reach it."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.calls += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _peers_settle(want: dict, timeout: float = 5.0) -> dict:
    """``open_connections_by_peer()`` once it equals ``want`` (the server counts on its own thread), else the last seen."""
    from broker.service.httpserver import open_connections_by_peer

    deadline = time.monotonic() + timeout
    while (seen := open_connections_by_peer()) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return seen


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))  # Linux routes all of 127.0.0.0/8 to lo: 127.0.0.2 is another peer
    s.connect(("127.0.0.1", port))
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _get(port: int, source: str = "127.0.0.1") -> bytes:
    """One ``GET /`` with ``Connection: close`` from ``source``: the whole answer."""
    with _connect(port, source) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return _read_all(s)


def test_a_peer_over_its_cap_is_refused_others_are_not_and_closing_frees_a_place(tmp_path, proto):
    from broker.service.httpserver import PEER_REFUSAL

    app = _CountingApp()
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections_per_peer=5),
                       protocol=proto)
    held = []
    try:
        assert _peers_settle({}) == {}
        held = [_connect(port) for _ in range(5)]  # idle: not a byte sent
        assert _peers_settle({"127.0.0.1": 5}) == {"127.0.0.1": 5}
        with _connect(port) as extra:  # the 6th from 127.0.0.1: answered and closed at once
            t0 = time.monotonic()
            answer = _read_all(extra)
            assert time.monotonic() - t0 < 1.0  # not held until a read timeout (1 s here)
        assert answer == PEER_REFUSAL and answer.startswith(b"HTTP/1.1 503 ")
        assert b"\r\nretry-after: 5\r\n" in answer and b"\r\nconnection: close\r\n" in answer
        # a refused connection's request never reaches the app, whether or not its answer arrives first
        with _connect(port) as extra:
            try:
                extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert _read_all(extra) in (PEER_REFUSAL, b"")
        assert app.calls == 0
        assert _peers_settle({"127.0.0.1": 5}) == {"127.0.0.1": 5}  # the refused ones were never counted
        # another address is not affected
        assert _get(port, "127.0.0.2").split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK" and app.calls == 1
        # the held ones still work, and closing one frees exactly one place
        held[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held[0].recv(4096).startswith(b"HTTP/1.1 200 ") and app.calls == 2
        held.pop().close()
        assert _peers_settle({"127.0.0.1": 4}) == {"127.0.0.1": 4}
        assert _get(port).split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK"
        held.append(_connect(port))
        assert _peers_settle({"127.0.0.1": 5}) == {"127.0.0.1": 5}
        assert _read_all(_connect(port)) == PEER_REFUSAL
    finally:
        for s in held:
            s.close()
        assert _peers_settle({}) == {}
        server.should_exit = True
        t.join(15)


def test_the_peer_count_has_no_leak_on_any_path(tmp_path, proto):
    """Many cycles of every way a connection ends (client close, reset, a finished request, a request cut
    mid-headers or mid-body, refusals, a read timeout, the server's shutdown): the count ends empty."""
    import struct

    app = _CountingApp()
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections_per_peer=8),
                       protocol=proto)
    try:
        for i in range(60):
            socks = [_connect(port, "127.0.0.1" if k % 2 else "127.0.0.3") for k in range(12)]  # 6 each: under 8
            socks[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            socks[1].sendall(b"GET / HTTP/1.1\r\nHo")
            socks[2].sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
            socks[3].sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            over = [_connect(port, "127.0.0.1") for _ in range(4)]  # 2 admitted (8), 2 refused
            socks[4].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            if i % 10 == 0:
                assert _peers_settle({"127.0.0.1": 8, "127.0.0.3": 6}) == {"127.0.0.1": 8, "127.0.0.3": 6}
            for s in socks + over:
                s.close()
        assert _peers_settle({}) == {}
        # a read timeout (1 s) closes it from the server's side
        slow = _connect(port)
        slow.sendall(b"GET / HTTP/1.1\r\nHo")
        assert _peers_settle({"127.0.0.1": 1}) == {"127.0.0.1": 1}
        assert _read_all(slow) == b""
        assert _peers_settle({}) == {}
        slow.close()
        # connections open when the server stops are given back too
        left = [_connect(port) for _ in range(3)]
        assert _peers_settle({"127.0.0.1": 3}) == {"127.0.0.1": 3}
        server.should_exit = True
        t.join(15)
        assert _peers_settle({}) == {}
        for s in left:
            s.close()
    finally:
        server.should_exit = True
        t.join(15)


def test_no_per_peer_cap_with_0(tmp_path):
    from broker.service.httpserver import open_connections_by_peer

    app = _CountingApp()
    port = _free_port()
    server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections=100,
                                           api_max_connections_per_peer=0), protocol=_FastHttpTools)
    held = []
    try:
        held = [_connect(port) for _ in range(20)]
        assert _get(port).split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK"
        assert open_connections_by_peer() == {}  # nothing counted
    finally:
        for s in held:
            s.close()
        server.should_exit = True
        t.join(15)


def test_a_peer_holding_its_cap_of_slow_connections_leaves_room_for_others(tmp_path, proto):
    """The hostile-review case: one host holds slow connections (headers trickling within the timeout) up to
    the process cap. Without a per-peer cap everyone else gets 503; with one, others get 200 at once."""
    app = _CountingApp()

    def run(per_peer: int) -> tuple[bytes, float]:
        port = _free_port()
        server, t = _serve(app, BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections=40,
                                               api_max_connections_per_peer=per_peer), protocol=proto)
        slow = []
        try:
            for _ in range(40):  # all it may hold: the process cap
                s = _connect(port)
                try:
                    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                except OSError:
                    pass
                slow.append(s)
            time.sleep(0.1)
            t0 = time.monotonic()
            answer = _get(port, "127.0.0.2")
            return answer.split(b"\r\n", 1)[0], time.monotonic() - t0
        finally:
            for s in slow:
                s.close()
            server.should_exit = True
            t.join(15)

    status, _ = run(0)
    assert status == b"HTTP/1.1 503 Service Unavailable"  # before: the one host filled the process cap
    status, took = run(10)
    assert status == b"HTTP/1.1 200 OK" and took < 0.5


def test_a_refused_peer_is_logged_once_a_minute(tmp_path, caplog, monkeypatch):
    from broker.service import httpserver
    from broker.service.log_throttle import KeyedLogThrottle

    clock = [0.0]
    monkeypatch.setattr(httpserver, "_refusal_log", KeyedLogThrottle(60.0, clock=lambda: clock[0]))
    port = _free_port()
    server, t = _serve(_CountingApp(), BrokerSettings(api_port=port, state_dir=tmp_path, api_max_connections_per_peer=1),
                       protocol=_FastHttpTools)
    held = []
    try:
        held = [_connect(port), _connect(port, "127.0.0.2")]
        assert _peers_settle({"127.0.0.1": 1, "127.0.0.2": 1}) == {"127.0.0.1": 1, "127.0.0.2": 1}
        with caplog.at_level("WARNING", logger="fedbroker.api.server"):
            for _ in range(3):
                _read_all(_connect(port))
            _read_all(_connect(port, "127.0.0.2"))
            clock[0] = 61.0
            _read_all(_connect(port))
        lines = [r.getMessage() for r in caplog.records if r.name == "fedbroker.api.server"]
        assert len(lines) == 3, lines
        assert lines[0] == ("refusing connections from 127.0.0.1: 1 open from that address, "
                            "api_max_connections_per_peer=1 (503, Retry-After 5 s; logged once a minute per address)")
        assert "127.0.0.2" in lines[1] and "127.0.0.1" in lines[2]
    finally:
        for s in held:
            s.close()
        server.should_exit = True
        t.join(15)


def test_peer_address_folds_ipv4_mapped_ipv6():
    from broker.service.httpserver import _peer_address

    assert _peer_address("::ffff:10.0.0.7") == "10.0.0.7"
    assert _peer_address("2001:db8::1") == "2001:db8::1" and _peer_address("10.0.0.7") == "10.0.0.7"


def test_keyed_log_throttle_once_per_key_and_bounded():
    from broker.service.log_throttle import KeyedLogThrottle

    clock = [0.0]
    t = KeyedLogThrottle(60.0, max_keys=2, clock=lambda: clock[0])
    assert t.due("a") and not t.due("a") and t.due("b")
    assert not t.due("c") and len(t) == 2  # full of keys still within their minute: a new one waits
    clock[0] = 30.0
    assert not t.due("a") and not t.due("c")
    clock[0] = 60.0
    assert t.due("c") and t.due("a") and len(t) == 2  # a and b forgotten, c and a remembered
    assert not t.due("a") and not t.due("b")
    with pytest.raises(ValueError, match=r"max_keys=0: must be >= 1"):
        KeyedLogThrottle(max_keys=0)
