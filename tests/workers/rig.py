"""The rig of the tests that run real jobs: a live API in a thread, the planning cycle and node agents with fake
GPUs, stepped by hand (the ``rig`` fixture of tests/workers/conftest.py builds it); :func:`sh` job specs."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.cycle import PlanningCycle
from broker.service.settings import BrokerSettings
from broker.service.tokens import create_node_token
from providers.nvml import FakeNvmlBackend
from workers.agent import NodeAgent
from workers.node_client import NodeClient
from workers.runtime import ProcessRuntime
from tests.conftest import PG_URL, REDIS_URL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ApiServer:
    """The API app served by uvicorn in a thread on 127.0.0.1 (stop and start again on the same port)."""

    def __init__(self, store, settings):
        self.app = create_app(store, settings)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.thread = None

    def start(self) -> "ApiServer":
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < end, "the API server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self.server = None


class Rig:
    """A store, an API server, the live planning cycle and one agent per node, stepped by hand."""

    #: every rig not yet closed (tests/workers/conftest.py closes them after each test)
    live: list["Rig"] = []

    def __init__(self, store, env, tmp_path: Path, nodes: dict[str, int]):
        Rig.live.append(self)
        self.made: list[NodeAgent] = []
        self.store = store
        self.tmp = tmp_path
        # jobs run under per-attempt uids here (the tests run as root): the agent's state is private, the jobs' root is not
        # the broker's services as the API tells the agents (GET /v1/node/config: blocked_endpoints): the test
        # Redis and PostgreSQL, which the agents' nftables tables keep their jobs from
        self.settings = BrokerSettings(state_dir=tmp_path / "state", cancel_grace_s=1.0, heartbeat_interval_s=0.2,
                                       jobs={"root": str(tmp_path / "jobs")}, redis_url=REDIS_URL, database_url=PG_URL,
                                       # team ml may use every priority class (the preemption tests submit critical)
                                       quotas={"per_team": {"ml": {"priority_classes": ["low", "normal", "high",
                                                                                        "critical"]}}})
        self.api = ApiServer(store, self.settings).start()
        self.tokens = {n: create_node_token(store, n) for n in nodes}
        self.backends = {n: FakeNvmlBackend(gpu_count=g) for n, g in nodes.items()}
        self.agents = {n: self.new_agent(n) for n in nodes}
        for a in self.agents.values():
            a.heartbeat()
        self.cycle = PlanningCycle(store, env, self.settings)

    def new_agent(self, name: str) -> NodeAgent:
        self.made.append(agent := self._agent(name))  # closed by close(), even when a test pops it from agents
        return agent

    def _agent(self, name: str) -> NodeAgent:
        return NodeAgent(NodeClient(self.api.url, self.tokens[name]), name, "local", self.backends[name],
                         state_dir=self.tmp / "state", runtime=ProcessRuntime(self.tmp / "state" / "agents" / name),
                         lease_root=self.tmp / "leases")  # this rig's uid leases: other tests' agents hold none

    def close(self) -> None:
        """Stop the API server and delete the agents' nftables tables (their jobs have ended by then)."""
        self.api.stop()
        for a in self.made:
            if a.guard is not None:
                a.guard.remove()
        if self in Rig.live:
            Rig.live.remove(self)

    def step(self) -> None:
        self.cycle.run()
        for a in self.agents.values():
            a.supervise_once()

    def until(self, pred, timeout: float = 20.0, what: str = "condition"):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            got = pred()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def state(self, job_id: str) -> str:
        return self.store.get(job_id).state


def sh(script: str, **kw) -> JobSpec:
    kw.setdefault("estimated_duration_s", 60.0)
    return JobSpec(command=["/bin/sh", "-c", script], **kw)
