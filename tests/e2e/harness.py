"""Runs the whole live broker as real processes for end-to-end tests.

:class:`LiveBroker` starts a private ``redis-server`` (so a test may restart it),
uses a fresh PostgreSQL schema, and runs ``fedbroker serve api``, ``worker``,
``beat`` and one ``agent`` per node as subprocesses with a shared YAML config.
Everything is torn down (processes killed, schema dropped) by :meth:`stop`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
import yaml

from tests.conftest import PG_URL

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    """Poll ``pred()`` until truthy; raise ``AssertionError`` naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - keep polling through transient errors
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class LiveBroker:
    """The broker's processes on this machine (see the module docstring).

    Args:
        workdir: a temporary directory for config, state and logs.
        nodes: ``{node_name: fake_gpu_count}`` — one agent each, in pool ``local``.
        settings: extra settings for the YAML file.
    """

    def __init__(self, workdir: Path, nodes: dict[str, int] | None = None, **settings):
        self.dir = Path(workdir)
        self.nodes = nodes or {"node-a": 4}
        self.schema = f"e2e_{uuid.uuid4().hex[:10]}"
        self.redis_port = free_port()
        self.api_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis: subprocess.Popen | None = None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "fedbroker.yaml"
        cfg = {
            "database_url": PG_URL,
            "database_schema": self.schema,
            "redis_url": f"redis://127.0.0.1:{self.redis_port}/0",
            "state_dir": str(self.dir / "state"),
            "jobs": {"root": str(self.dir / "jobs")},  # reachable by the job user (a per-attempt uid when run as root)
            "api_port": self.api_port,
            "plan_interval_s": 1.0,
            "reconcile_interval_s": 1.0,
            "heartbeat_interval_s": 0.5,
            "node_lost_after_s": 8.0,
            "dispatch_retry_s": 3.0,
            "starting_deadline_s": 30.0,
            "cancel_grace_s": 2.0,
            "planner_lock_ttl_s": 10.0,
        }
        cfg.update(settings)
        self.settings = cfg
        self.config.write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.env = {**os.environ, "FEDBROKER_CONFIG": str(self.config), "PYTHONPATH": str(REPO),
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("FEDBROKER_API_URL", None)
        self.env.pop("FEDBROKER_TOKEN", None)

    # ------------------------------------------------------------------ processes
    def start_redis(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.redis = subprocess.Popen([exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(self.dir)],
                                      stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT)
        import redis

        wait_for(lambda: redis.Redis(port=self.redis_port).ping(), 10, "redis-server")

    def restart_redis(self, down_s: float = 1.0) -> None:
        """Kill the Redis server (all queued messages are lost: it keeps nothing on disk) and start it again."""
        self.redis.kill()
        self.redis.wait()
        time.sleep(down_s)
        self.start_redis()

    def _spawn(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "broker.cli.main", "serve", *args, "--log-level", "info"],
                             cwd=self.dir, env=env or self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def start_agent(self, node: str) -> None:
        """An agent as on a host of its own: the API URL and a node token, no settings file, no database."""
        from broker.cli.serve import agent_environment
        from broker.service.tokens import create_node_token

        env = agent_environment(create_node_token(self.store, node), self.url, base=self.env)
        self._spawn(f"agent-{node}", "agent", "--name", node, "--pool", "local", "--nvml", "fake",
                    "--fake-gpus", str(self.nodes[node]), "--state-dir", str(self.dir / "state"), env=env)

    def start_worker(self, name: str = "worker") -> None:
        self._spawn(name, "worker")

    def start_beat(self, name: str = "beat") -> None:
        self._spawn(name, "beat")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        p.send_signal(sig)
        p.wait(timeout=30)

    def pause(self, name: str) -> None:
        """Freeze process ``name`` (SIGSTOP): it holds its sockets and state but does nothing until :meth:`resume`
        (or a SIGKILL). Used to hold a job at one lifecycle step."""
        self.procs[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """Let a process frozen by :meth:`pause` go on (SIGCONT)."""
        self.procs[name].send_signal(signal.SIGCONT)

    def restart(self, name: str) -> None:
        """Start process ``name`` again (``api``, ``worker*``, ``beat*`` or ``agent-<node>``) after it died; for the
        API, wait until ``/healthz`` answers 200 (at most 60 s, else ``AssertionError``)."""
        if name.startswith("agent-"):
            self.start_agent(name.removeprefix("agent-"))
        elif name.startswith("worker"):
            self.start_worker(name)
        elif name.startswith("beat"):
            self.start_beat(name)
        elif name == "api":
            self._spawn("api", "api")
            wait_for(lambda: requests.get(f"{self.url}/healthz", timeout=2).status_code == 200, 60, "the API")
        else:
            raise ValueError(f"name={name!r}: not a process of this broker ({', '.join(sorted(self.procs))})")

    def start(self) -> "LiveBroker":
        from broker.service.store.core import JobStore

        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        self.store = JobStore(PG_URL, schema=self.schema)
        self.store.migrate()
        self._spawn("api", "api")
        self.start_worker()
        self.start_beat()
        for n in self.nodes:
            self.start_agent(n)
        wait_for(lambda: requests.get(f"{self.url}/healthz", timeout=2).status_code == 200, 60, "the API")
        wait_for(lambda: {n.name for n in self.store.nodes() if n.state == "up"} >= set(self.nodes), 60,
                 "every agent's first heartbeat")
        return self

    def token(self, team: str, admin: bool = False) -> str:
        from broker.service.tokens import create_token

        return create_token(self.store, team, "admin" if admin else "member").token

    def logs(self) -> str:
        """The tail of every process log (for assertion messages)."""
        out = []
        for f in sorted(self.dir.glob("*.log")):
            out.append(f"==== {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        # job processes run under detached shims: stop whatever is left of them
        subprocess.run(["pkill", "-9", "-f", str(self.dir / "state")], check=False)
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
        try:
            self.store.drop_schema()
        except Exception:  # noqa: BLE001
            pass
