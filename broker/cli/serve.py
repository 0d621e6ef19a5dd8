"""``fedbroker serve {api,worker,beat,agent,all}``: the live broker's processes.

* ``api`` — the HTTP API (uvicorn), migrates the schema first;
* ``worker`` — a Celery worker on the ``planning`` and ``provisioning`` queues (and, for one release, the
  ``dispatch`` queue an earlier release sent cloud placements to);
* ``beat`` — Celery beat: a planning cycle every ``plan_interval_s``, a reconciler pass every
  ``reconcile_interval_s`` (safe to run twice);
* ``agent`` — the node agent of this host (:mod:`workers.agent`): polls the node API with a
  node token (``--api-url``, ``FEDBROKER_NODE_TOKEN`` or ``--token-file``); holds no database
  or Redis URL and reads no settings file;
* ``all`` — the four above as child processes of one command, for a single-machine
  trial (agent: this host, fake NVML GPUs unless real ones are found). It mints the local
  agent's node token itself and gives the agent an environment without the broker's
  settings (:func:`agent_environment`). Ctrl-C stops them.

Each ``serve`` command but ``agent`` reads :class:`broker.service.settings.BrokerSettings` (``--config FILE``,
``FEDBROKER_*`` variables).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from broker.service.redact import mask_url
from broker.service.service_endpoints import passwordless, trial_notice
from broker.service.settings import BrokerSettings, SettingsError, load_settings

__all__ = ["register", "agent_environment"]

log = logging.getLogger("fedbroker.serve")
serve_app = typer.Typer(no_args_is_help=True, help="Run the live broker's processes (API, Celery worker, beat, node agent).")

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML settings file (else $FEDBROKER_CONFIG).")


def _settings(config: Optional[Path]) -> BrokerSettings:
    """The settings; also masks their secrets (database and Redis passwords, admin token) in every log
    line from here on (:func:`broker.service.redact.install_secret_filter`; call it after :func:`_logging`)."""
    from broker.service.redact import install_secret_filter

    try:
        st = load_settings(config)
    except SettingsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    install_secret_filter(st)
    path = config or os.environ.get("FEDBROKER_CONFIG")
    try:
        mode = os.stat(path).st_mode if path else None
    except OSError:
        mode = None
    if mode is not None and mode & 0o077:
        # it holds the database URL (and maybe a password): a job running on this host as another user could read it
        log.warning("settings file %s is mode %04o, readable by other users; `chmod 600` it (it holds the "
                    "database and Redis URLs)", path, mode & 0o777)
    return st


def _logging(level: str) -> None:
    """Log at ``level`` (``--log-level``); Celery's, kombu's and Alembic's loggers at WARNING unless ``level`` is
    ``debug``: at INFO Celery and kombu wrote two lines every ``plan_interval_s`` (beat sending ``fedbroker.plan``,
    the worker's ``Task ... succeeded``), 630 KB in 15 minutes of an idle broker, and Alembic seven lines per
    process at each start."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=lvl, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("celery", "kombu", "alembic"):
        logging.getLogger(name).setLevel(lvl if lvl <= logging.DEBUG else max(lvl, logging.WARNING))
    # the Celery worker sets the ROOT logger to its own (WARNING) level: keep ours at ``level``
    logging.getLogger("fedbroker").setLevel(lvl)


def _celery_level(level: str) -> str:
    """The ``--loglevel`` handed to Celery for our ``--log-level`` (see :func:`_logging`)."""
    return "DEBUG" if level.lower() == "debug" else max(level.upper(), "WARNING", key=logging.getLevelName)


def _migrate(st: BrokerSettings):
    from broker.service.store.core import JobStore

    store = JobStore.from_settings(st)
    store.migrate()
    return store


@serve_app.command("api")
def serve_api(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level"),
              certfile: Optional[Path] = typer.Option(None, "--certfile", help="PEM certificate (chain): serve HTTPS "
                                                      "(with --keyfile; default: settings api_certfile)."),
              keyfile: Optional[Path] = typer.Option(None, "--keyfile", help="PEM private key of --certfile "
                                                     "(default: settings api_keyfile)."),
              workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64,
                                                    help="uvicorn worker processes (default: settings.api_workers)")) -> None:
    """HTTP API on ``api_host:api_port`` (OpenAPI at /docs), HTTPS with ``--certfile/--keyfile``; ``--workers N``
    runs N processes on one port. Header and body read timeouts, keep-alive and connection limits:
    :mod:`broker.service.httpserver`."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from broker.service.httpserver import server_config

    _logging(log_level)
    st = _settings(config)
    if certfile is not None or keyfile is not None:
        st = st.model_copy(update={"api_certfile": certfile or st.api_certfile, "api_keyfile": keyfile or st.api_keyfile})
    _migrate(st)
    n = workers or st.api_workers
    log.info("api on %s:%s (%d process%s); database %s; Redis %s", st.api_host, st.api_port, n, "es" if n > 1 else "",
             mask_url(st.effective_database_url), mask_url(st.redis_url))
    try:
        if n == 1:
            cfg = server_config(api_app(st), st, log_level=log_level)
        else:
            if config is not None:  # the worker processes read the same file
                os.environ["FEDBROKER_CONFIG"] = str(Path(config).resolve())
            for name in ("api_certfile", "api_keyfile"):  # and the same TLS files as given here
                if getattr(st, name) is not None:
                    os.environ[f"FEDBROKER_{name.upper()}"] = str(getattr(st, name))
            cfg = server_config("broker.cli.serve:api_app", st, log_level=log_level, factory=True, workers=n)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)

    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the handler that was
    # there before: with this one the process then exits 0 (a clean stop, not "killed by SIGTERM")
    def _exit_clean(signum, frame):  # before uvicorn runs: stop now; after its graceful shutdown: exit 0
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_clean)
    if n == 1:
        uvicorn.Server(cfg).run()
    else:
        Multiprocess(cfg, sockets=[cfg.bind_socket()]).run()


def api_app(st: Optional[BrokerSettings] = None):
    """The API as ``serve api`` runs it, for ``st`` or the settings :func:`_settings` loads (secrets masked in
    the logs): :func:`broker.service.wiring.build_api`, the one composition root. The factory of each uvicorn
    worker process of ``serve api --workers N``."""
    from broker.service.wiring import build_api

    return build_api(st or _settings(None))


@serve_app.command("worker")
def serve_worker(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level"),
                 queues: str = typer.Option("planning,dispatch,provisioning", "--queues",
                                            help="Comma-separated queues to take: planning, provisioning (cloud "
                                                 "placements go straight there); e.g. a second worker with --queues "
                                                 "provisioning keeps slow cloud create calls off the planner's way. "
                                                 "dispatch (in the default for one release) only drains messages an "
                                                 "earlier release queued there.")) -> None:
    """Celery worker for planning and provisioning tasks (one task at a time; run more workers for more
    throughput). The ``dispatch`` queue, taken by default for one release, only holds ``fedbroker.dispatch``
    messages an earlier release queued (cloud placements now go straight to ``provisioning``).

    It uses Celery's ``solo`` pool: with the ``threads`` pool, kombu's Redis transport lost
    its consumer after a Redis restart (``'NoneType' object has no attribute 'hostname'``,
    kombu 5.7) and the worker silently stopped taking tasks; ``solo`` reconnects.
    """
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    bad = [q for q in wanted if q not in ("planning", "dispatch", "provisioning")]
    if not wanted or bad:
        what = f"unknown queue(s) {', '.join(bad)}" if bad else "no queue given"
        typer.echo(f"error: --queues={queues!r}: {what}; use planning and/or provisioning", err=True)
        raise typer.Exit(2)
    from broker.service.celery_app import get_app, quiet_root_warning

    _logging(log_level)
    st = _settings(config)
    app = get_app(st)
    _migrate(st)
    quiet_root_warning(app)  # JSON only, never a job's code: Celery's root warning does not apply (its docstring)
    app.worker_main(["worker", "-Q", ",".join(wanted), "--pool", "solo",
                     "-n", f"broker-{os.getpid()}@{socket.gethostname()}", "--loglevel", _celery_level(log_level),
                     "--without-gossip", "--without-mingle"])


@serve_app.command("beat")
def serve_beat(config: Optional[Path] = ConfigOpt, log_level: str = typer.Option("info", "--log-level")) -> None:
    """Celery beat: planning cycles and reconciler passes on a timer.

    The schedule is kept in memory (``celery.beat:Scheduler``): its two entries are short intervals,
    so nothing is worth persisting, and the per-process ``beat-schedule-<pid>`` files of earlier
    versions piled up in ``state_dir`` across restarts (they are removed here)."""
    from celery.apps.beat import Beat

    from broker.service.celery_app import get_app

    _logging(log_level)
    st = _settings(config)
    app = get_app(st)
    if st.state_dir.is_dir():
        for old in st.state_dir.glob("beat-schedule-*"):
            old.unlink(missing_ok=True)
    Beat(app=app, scheduler="celery.beat:Scheduler", loglevel=_celery_level(log_level), quiet=True).run()


def _node_token(token_file: Optional[Path]) -> str:
    """The node token: from ``--token-file`` (must not be readable by group or others), else
    ``$FEDBROKER_NODE_TOKEN``. Exits 2 naming what is missing or wrong."""
    if token_file is not None:
        try:
            mode = token_file.stat().st_mode
            text = token_file.read_text().strip()
        except OSError as e:
            typer.echo(f"error: --token-file={str(token_file)!r}: {e.strerror}", err=True)
            raise typer.Exit(2)
        if mode & 0o077:
            typer.echo(f"error: --token-file={str(token_file)!r}: mode {mode & 0o777:o} lets others read it; "
                       "chmod 600 it", err=True)
            raise typer.Exit(2)
        return text
    token = os.environ.get("FEDBROKER_NODE_TOKEN", "").strip()
    if not token:
        typer.echo("error: no node token: set FEDBROKER_NODE_TOKEN or give --token-file "
                   "(mint one with `fedbroker nodes token HOST`)", err=True)
        raise typer.Exit(2)
    return token


@serve_app.command("agent")
def serve_agent(api_url: str = typer.Option(..., "--api-url", envvar="FEDBROKER_API_URL",
                                            help="The broker API's URL (the agent talks to nothing else)."),
                token_file: Optional[Path] = typer.Option(None, "--token-file",
                                                          help="File holding the node token (mode 0600); "
                                                               "else $FEDBROKER_NODE_TOKEN."),
                name: str = typer.Option(None, "--name", help="Node name (default: this host's name); "
                                                              "must be the node the token names."),
                pool: str = typer.Option("local", "--pool", help="On-prem pool of this node (in the cluster file)."),
                state_dir: Path = typer.Option(Path(".fedbroker"), "--state-dir",
                                               help="Where the jobs' directories, logs and checkpoints live."),
                nvml: str = typer.Option("auto", "--nvml", help="auto | nvml | fake"),
                fake_gpus: int = typer.Option(4, "--fake-gpus", min=1, max=16, help="GPUs of the fake NVML backend."),
                fake_gpu_name: str = typer.Option("Tesla V100-SXM2-16GB", "--fake-gpu-name"),
                log_level: str = typer.Option("info", "--log-level")) -> None:
    """The node agent of this host: heartbeats with NVML telemetry and runs the jobs placed here.

    It reads no settings file and holds no database or Redis URL: only ``--api-url`` and a node
    token (``FEDBROKER_NODE_TOKEN`` or ``--token-file``). The heartbeat interval, cancel grace
    and log chunking come from the API (``GET /v1/node/config``)."""
    from providers.nvml import open_backend
    from workers.agent import NodeAgent
    from workers.network_guard import NetworkGuardError
    from workers.node_client import NodeApiError, NodeApiUnavailable, NodeClient

    _logging(log_level)
    name = name or socket.gethostname().split(".")[0]
    token = _node_token(token_file)
    os.environ.pop("FEDBROKER_NODE_TOKEN", None)  # jobs inherit what the agent's environment still holds
    try:
        backend = open_backend(nvml, fake_gpus=fake_gpus, fake_gpu_name=fake_gpu_name)
    except ValueError as e:
        typer.echo(f"error: --nvml={nvml!r}: {e}", err=True)
        raise typer.Exit(2)
    try:
        client = NodeClient(api_url, token)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    agent = NodeAgent(client, name, pool, backend, state_dir=state_dir)
    stop = _stop_on_signals()
    while not stop.is_set():  # the jobs' user and directories, from the API's settings (it may still be starting)
        try:
            agent.prepare()
            break
        except NodeApiUnavailable as e:
            log.warning("node API: %s; trying again in 1 s", e)
            time.sleep(1.0)
        except (NodeApiError, ValueError, OSError, NetworkGuardError) as e:  # refused token; jobs.user / jobs.root
            # (workers.isolation); no nft (workers.network_guard)
            typer.echo(f"error: node agent {name!r}: {e}", err=True)
            raise typer.Exit(2)
    agent.start()
    log.info("agent %s (pool %s, %s NVML) polling %s", name, pool, type(backend).__name__, api_url)
    try:
        while not stop.is_set():
            time.sleep(0.2)
    finally:
        agent.stop()


@serve_app.command("all")
def serve_all(config: Optional[Path] = ConfigOpt,
              agent_name: str = typer.Option(None, "--agent-name", help="Node name of this host's agent."),
              fake_gpus: int = typer.Option(4, "--fake-gpus", min=1, max=16),
              log_level: str = typer.Option("info", "--log-level"),
              trial: bool = typer.Option(False, "--trial", help="A single-user trial: run with a Redis or database "
                                         "that has no password (refused otherwise), with a warning.")) -> None:
    """API + worker + beat + this host's agent, as child processes (single-machine trial).

    It refuses a ``redis_url`` or ``database_url`` without a password (a job that reaches one can stop planning
    for every team or read the job store) unless ``--trial`` (or the ``trial`` setting) is given; it then
    prints :func:`trial_banner` and ``/healthz`` carries the same notice (exit status 2 when refused)."""
    _logging(log_level)
    if trial:
        os.environ["FEDBROKER_TRIAL"] = "1"  # the API, worker and beat children read it too (the agent does not)
    st = _settings(config)
    open_ = passwordless(st)
    if open_ and not st.trial:
        typer.echo(refusal(open_), err=True)
        raise typer.Exit(2)
    if st.trial:
        typer.echo(trial_banner(st), err=True)
    store = _migrate(st)
    base = [sys.executable, "-m", "broker.cli.main", "serve"]
    extra = ["--config", str(config)] if config else []
    node = agent_name or socket.gethostname().split(".")[0]
    cmds = {
        "api": base + ["api", *extra, "--log-level", log_level],
        "worker": base + ["worker", *extra, "--log-level", log_level],
        "beat": base + ["beat", *extra, "--log-level", log_level],
        "agent": base + ["agent", "--log-level", log_level, "--fake-gpus", str(fake_gpus), "--name", node,
                         "--api-url", st.effective_api_url, "--state-dir", str(st.state_dir.resolve())],
    }
    # this command is the composition root: it holds the database credentials and mints the local
    # agent's node token; the agent gets that token and the API URL only (no config, no database URL)
    from broker.service.tokens import create_node_token, revoke_node_tokens

    revoke_node_tokens(store, node, SERVE_ALL_LABEL)  # the token of an earlier start stops working
    agent_env = agent_environment(create_node_token(store, node, label=SERVE_ALL_LABEL), st.effective_api_url)
    stop = _stop_on_signals()
    # the API first, the others once it listens: started together, the four children's imports share the
    # CPUs and the API took 10-15 s to answer (connections refused meanwhile); alone it takes ~3 s
    procs = {"api": subprocess.Popen(cmds["api"])}
    _wait_listening(st.api_host, st.api_port, procs["api"], timeout_s=60.0, stop=stop.is_set)
    if not stop.is_set():
        procs.update({k: subprocess.Popen(v, env=agent_env if k == "agent" else None)
                      for k, v in cmds.items() if k != "api"})
    typer.echo(f"fedbroker: API on {st.effective_api_url}, database {mask_url(st.effective_database_url)}, "
               f"Redis {mask_url(st.redis_url)}; Ctrl-C stops")
    code = 0
    while not stop.is_set():
        for k, p in procs.items():
            if p.poll() is not None:
                typer.echo(f"fedbroker: {k} exited with {p.returncode}; stopping the others", err=True)
                code = p.returncode or 1
                stop.set()
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


def refusal(endpoints) -> str:
    """The error ``serve all`` exits with when ``endpoints`` (:class:`ServiceEndpoint`, password-less) are given
    without ``--trial``."""
    names = "; ".join(e.describe() for e in endpoints)
    return (f"error: serve all: no password in {names}. serve all runs other people's jobs on this host, and a "
            "job that reaches a password-less Redis can stop planning for every team (fedbroker:planner-lock) or "
            "lock a team out (fedbroker:rate:<team>); one that reaches the database can read every job. Give the "
            "service a password and put it in the URL (Redis: requirepass, redis_url: redis://:PASSWORD@HOST:6379/0; "
            "PostgreSQL: database_url: postgresql+psycopg://USER:PASSWORD@HOST/DB), or pass --trial for a "
            "single-user trial on this machine")


def trial_banner(st: BrokerSettings) -> str:
    """The WARNING block ``serve all --trial`` prints at start (stderr)."""
    rule = "=" * 78
    return "\n".join([rule, "WARNING: fedbroker is running in TRIAL mode (serve all --trial)",
                      f"  {trial_notice(st)}.",
                      *(["  This host's root agent refuses its jobs' uids TCP to these services and hides their UNIX",
                         "  sockets; jobs on any other machine that reaches them are not held back."]
                        if os.geteuid() == 0 else
                        ["  The agent does not run as root: its jobs run as this user and CAN reach these services."]),
                      "  Do not let anyone else submit jobs here; give Redis and the database passwords first.",
                      rule])


#: the label of the node token ``serve all`` mints for its local agent (the previous one is revoked at each start)
SERVE_ALL_LABEL = "serve all"


def _stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set (the loops of ``serve agent`` and ``serve all`` watch it)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def agent_environment(token: str, api_url: str, base: dict | None = None) -> dict:
    """The environment of a node agent child process, built explicitly from ``base`` (default
    ``os.environ``): ``PATH``, locale, ``HOME``, ``PYTHONPATH`` and NCCL/CUDA host settings pass;
    every ``FEDBROKER_*`` variable (config file, database URL, admin token, team token) is dropped;
    ``FEDBROKER_NODE_TOKEN`` and ``FEDBROKER_API_URL`` are set."""
    base = os.environ if base is None else base
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED",
            "VIRTUAL_ENV", "USER", "LOGNAME")
    env = {k: v for k, v in base.items()
           if k in keep or k.startswith(("NCCL_", "CUDA_", "NVIDIA_"))}
    env["FEDBROKER_NODE_TOKEN"] = token
    env["FEDBROKER_API_URL"] = api_url
    return env


def _wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float,
                    stop=lambda: False) -> bool:
    """Wait until something accepts TCP connections on ``host:port`` (``0.0.0.0``/``::`` = loopback), ``proc``
    exits, ``stop()`` is true or ``timeout_s`` seconds pass. True when it listens."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not stop():
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``fedbroker`` CLI."""
    app.add_typer(serve_app, name="serve")
