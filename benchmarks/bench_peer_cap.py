"""One host holding slow connections against ``serve api``: what another client's request gets.

Runs the API (``create_app`` on an SQLite store, :func:`broker.service.httpserver.server_config`, httptools)
in this process, then a hostile peer (``127.0.0.1``) opens ``--slow`` connections that each send a few header
bytes and stop (within the 10 s header timeout: a slow-loris), and a legitimate client on another address
(``127.0.0.2``, Linux loopback) sends ``--requests`` ``GET /healthz``, one connection each. Once without a
per-address cap (``api_max_connections_per_peer=0``: the hostile peer fills ``api_max_connections`` and the
legitimate requests are 503) and once with ``--per-peer`` (64 by default), plus a baseline without the
hostile peer. All measured within the header timeout, so no slow connection is cut meanwhile.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_peer_cap.py [--slow 1100] [--max-connections 1000]
        [--per-peer 64] [--requests 50]

Prints one Markdown row per case (statuses of the legitimate requests, p50/max latency, ms).
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.service.api import create_app  # noqa: E402
from broker.service.httpserver import open_connections_by_peer, server_config  # noqa: E402
from broker.service.settings import BrokerSettings  # noqa: E402
from broker.service.store.core import JobStore  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, source: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with socket.socket() as s:
        s.settimeout(10)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), (time.perf_counter() - t0) * 1000


def run(app, tmp: Path, slow: int, max_connections: int, per_peer: int, n: int) -> dict:
    import uvicorn

    port = _free_port()
    cfg = server_config(app, BrokerSettings(api_port=port, state_dir=tmp, api_max_connections=max_connections,
                                            api_max_connections_per_peer=per_peer))
    server = uvicorn.Server(cfg)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    held = []
    try:
        t0 = time.monotonic()
        for _ in range(slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            except OSError:  # refused and closed already
                pass
            held.append(s)
        time.sleep(0.2)
        hostile = open_connections_by_peer().get("127.0.0.1", len(held) if per_peer == 0 else 0)
        results = [_request(port, "127.0.0.2") for _ in range(n)]
        assert time.monotonic() - t0 < 9.0, "took past the header timeout: slow connections were cut meanwhile"
        ms = sorted(r[1] for r in results)
        return {"slow": slow, "per_peer": per_peer, "hostile_held": hostile,
                "statuses": dict(collections.Counter(r[0] for r in results)),
                "p50_ms": ms[len(ms) // 2], "max_ms": ms[-1]}
    finally:
        for s in held:
            s.close()
        server.should_exit = True
        t.join(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow", type=int, default=1100, help="slow connections the hostile peer opens")
    ap.add_argument("--max-connections", type=int, default=1000, help="api_max_connections")
    ap.add_argument("--per-peer", type=int, default=64, help="api_max_connections_per_peer of the capped case")
    ap.add_argument("--requests", type=int, default=50, help="legitimate requests per case")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    store = JobStore(f"sqlite:///{tmp / 'fedbroker.db'}")
    store.migrate()
    app = create_app(store)
    rows = [("no hostile peer", run(app, tmp, 0, a.max_connections, a.per_peer, a.requests)),
            ("hostile peer, no per-peer cap", run(app, tmp, a.slow, a.max_connections, 0, a.requests)),
            (f"hostile peer, per-peer cap {a.per_peer}", run(app, tmp, a.slow, a.max_connections, a.per_peer, a.requests))]
    print(f"| case (api_max_connections={a.max_connections}) | slow opened | held by it | legitimate answers | p50 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['slow']} | {r['hostile_held']} | {r['statuses']} | {r['p50_ms']:.1f} | {r['max_ms']:.1f} |")


if __name__ == "__main__":
    main()
