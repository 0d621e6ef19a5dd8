"""``fedbroker serve {api,worker,beat,agent,all}``: the live broker's processes.

* ``api`` — the HTTP API (uvicorn), migrates the schema first;
* ``worker`` — a Celery worker on the ``planning``, ``dispatch`` and ``provisioning`` queues;
* ``beat`` — Celery beat: a planning cycle every ``plan_interval_s``, a reconciler pass every
  ``reconcile_interval_s`` (safe to run twice);
* ``agent`` — the node agent of this host (:mod:`workers.agent`) on queue ``node.<name>``;
* ``all`` — the four above as child processes of one command, for a single-machine
  trial (agent: this host, fake NVML GPUs unless real ones are found). Ctrl-C stops them.

Each ``serve`` command reads :class:`broker.settings.BrokerSettings` (``--config FILE``,
``FEDBROKER_*`` variables).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from broker.settings import BrokerSettings, SettingsError, load_settings

__all__ = ["register"]

log = logging.getLogger("fedbroker.serve")
serve_app = typer.Typer(no_args_is_help=True, help="Run the live broker's processes (API, Celery worker, beat, node agent).")

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML settings file (else $FEDBROKER_CONFIG).")


def _settings(config: Optional[Path]) -> BrokerSettings:
    try:
        return load_settings(config)
    except SettingsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _migrate(st: BrokerSettings):
    from broker.store import JobStore

    store = JobStore.from_settings(st)
    store.migrate()
    return store


@serve_app.command("api")
def serve_api(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level"),
              workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64,
                                                    help="uvicorn worker processes (default: settings.api_workers)")) -> None:
    """HTTP API on ``api_host:api_port`` (OpenAPI at /docs); ``--workers N`` runs N processes on one port."""
    import uvicorn

    _logging(log_level)
    st = _settings(config)
    _migrate(st)
    n = workers or st.api_workers
    if config is not None:  # the worker processes read the same file
        os.environ["FEDBROKER_CONFIG"] = str(Path(config).resolve())
    if n == 1:
        uvicorn.run(api_app(st), host=st.api_host, port=st.api_port, log_level=log_level, access_log=False)
    else:
        uvicorn.run("broker.serve:api_app", factory=True, workers=n, host=st.api_host, port=st.api_port,
                    log_level=log_level, access_log=False)


def api_app(st: Optional[BrokerSettings] = None):
    """The API as ``serve api`` runs it (planner wake-ups through Celery, cloud reports, the Redis rate
    limit), for ``st`` or :func:`broker.settings.load_settings`; the factory of each uvicorn worker process."""
    from broker.api import create_app
    from broker.celery_app import get_app
    from broker.limits import RateLimiter
    from broker.store import JobStore
    from broker.tasks import kick_planner

    st = st or load_settings()
    get_app(st)
    store = JobStore.from_settings(st)
    cloud = None
    if st.cloud_providers:  # cloud instances report here
        from broker.cloud import CloudBroker
        from broker.tasks import send_teardown

        cloud = CloudBroker(store, st, teardown=send_teardown)
    return create_app(store, st, on_submit=lambda job_id: kick_planner(), cloud=cloud,
                      rate_limiter=RateLimiter.from_settings(st))


@serve_app.command("worker")
def serve_worker(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level"),
                 queues: str = typer.Option("planning,dispatch,provisioning", "--queues",
                                            help="Comma-separated queues to take (planning, dispatch, provisioning); "
                                                 "e.g. a second worker with --queues provisioning keeps slow cloud "
                                                 "create calls off the planner's way.")) -> None:
    """Celery worker for planning, dispatch and provisioning tasks (one task at a time; run more
    workers for more throughput).

    It uses Celery's ``solo`` pool: with the ``threads`` pool, kombu's Redis transport lost
    its consumer after a Redis restart (``'NoneType' object has no attribute 'hostname'``,
    kombu 5.7) and the worker silently stopped taking tasks; ``solo`` reconnects.
    """
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    bad = [q for q in wanted if q not in ("planning", "dispatch", "provisioning")]
    if not wanted or bad:
        what = f"unknown queue(s) {', '.join(bad)}" if bad else "no queue given"
        typer.echo(f"error: --queues={queues!r}: {what}; use planning, dispatch and/or provisioning", err=True)
        raise typer.Exit(2)
    from broker.celery_app import get_app

    _logging(log_level)
    st = _settings(config)
    app = get_app(st)
    _migrate(st)
    app.worker_main(["worker", "-Q", ",".join(wanted), "--pool", "solo",
                     "-n", f"broker-{os.getpid()}@{socket.gethostname()}", "--loglevel", log_level.upper(),
                     "--without-gossip", "--without-mingle"])


@serve_app.command("beat")
def serve_beat(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level")) -> None:
    """Celery beat: planning cycles and reconciler passes on a timer."""
    from celery.apps.beat import Beat

    from broker.celery_app import get_app

    _logging(log_level)
    st = _settings(config)
    app = get_app(st)
    st.state_dir.mkdir(parents=True, exist_ok=True)
    Beat(app=app, schedule=str(st.state_dir / f"beat-schedule-{os.getpid()}"), loglevel=log_level.upper(),
         quiet=True).run()


@serve_app.command("agent")
def serve_agent(config: Optional[Path] = ConfigOpt,
                name: str = typer.Option(None, "--name", help="Node name (default: this host's name)."),
                pool: str = typer.Option("local", "--pool", help="On-prem pool of this node (in the cluster file)."),
                nvml: str = typer.Option("auto", "--nvml", help="auto | nvml | fake"),
                fake_gpus: int = typer.Option(4, "--fake-gpus", min=1, max=16, help="GPUs of the fake NVML backend."),
                fake_gpu_name: str = typer.Option("Tesla V100-SXM2-16GB", "--fake-gpu-name"),
                log_level: str = typer.Option("info", "--log-level")) -> None:
    """The node agent of this host: heartbeats with NVML telemetry and runs placed jobs as processes."""
    from broker.celery_app import get_app, node_queue
    from broker.store import JobStore
    from broker.tasks import kick_planner
    from providers.nvml import open_backend
    from workers.agent import NodeAgent, set_current_agent

    _logging(log_level)
    st = _settings(config)
    app = get_app(st)
    name = name or socket.gethostname().split(".")[0]
    try:
        backend = open_backend(nvml, fake_gpus=fake_gpus, fake_gpu_name=fake_gpu_name)
    except ValueError as e:
        typer.echo(f"error: --nvml={nvml!r}: {e}", err=True)
        raise typer.Exit(2)
    store = JobStore.from_settings(st)
    agent = NodeAgent(store, st, name, pool, backend, on_change=kick_planner)
    set_current_agent(agent)
    agent.start()
    log.info("agent %s (pool %s, %s NVML) consuming %s", name, pool, type(backend).__name__, node_queue(name))
    try:
        app.worker_main(["worker", "-Q", node_queue(name), "--pool", "solo", "-n", f"agent-{name}@{socket.gethostname()}",
                         "--loglevel", log_level.upper(), "--without-gossip", "--without-mingle"])
    finally:
        agent.stop()


@serve_app.command("all")
def serve_all(config: Optional[Path] = ConfigOpt,
              agent_name: str = typer.Option(None, "--agent-name", help="Node name of this host's agent."),
              fake_gpus: int = typer.Option(4, "--fake-gpus", min=1, max=16),
              log_level: str = typer.Option("info", "--log-level")) -> None:
    """API + worker + beat + this host's agent, as child processes (single-machine trial)."""
    _logging(log_level)
    st = _settings(config)
    _migrate(st)
    base = [sys.executable, "-m", "broker.cli", "serve"]
    extra = ["--config", str(config)] if config else []
    cmds = {
        "api": base + ["api", *extra, "--log-level", log_level],
        "worker": base + ["worker", *extra, "--log-level", log_level],
        "beat": base + ["beat", *extra, "--log-level", log_level],
        "agent": base + ["agent", *extra, "--log-level", log_level, "--fake-gpus", str(fake_gpus)]
        + (["--name", agent_name] if agent_name else []),
    }
    procs = {k: subprocess.Popen(v) for k, v in cmds.items()}
    typer.echo(f"fedbroker: API on {st.effective_api_url}, database {st.effective_database_url}, "
               f"Redis {st.redis_url}; Ctrl-C stops")
    stopping = False

    def _stop(signum=None, frame=None):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    while not stopping:
        for k, p in procs.items():
            if p.poll() is not None:
                typer.echo(f"fedbroker: {k} exited with {p.returncode}; stopping the others", err=True)
                code = p.returncode or 1
                stopping = True
                break
        time.sleep(0.5)
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs.values():
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``fedbroker`` CLI."""
    app.add_typer(serve_app, name="serve")
