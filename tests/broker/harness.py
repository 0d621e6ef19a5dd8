"""Helpers of the tests that talk to the API over real HTTP: :class:`ServerThread` (the app under uvicorn on a
free port) and :func:`count_jobs` (a team's stored jobs)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from sqlalchemy import func, select

from broker.service.store.core import JobStore
from broker.service.store.tables import Job


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a daemon thread.

    ``with ServerThread(app) as srv: srv.url`` — started when the block is entered, stopped after.
    """

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        end = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def count_jobs(store: JobStore, team: str) -> int:
    """How many jobs of ``team`` the store holds."""
    with store.session() as s:
        return s.execute(select(func.count()).select_from(Job).where(Job.team == team)).scalar_one()
