"""A local fake cloud whose instances really run their user data, on this machine.

End-to-end tests create instances through the real provider adapters (``providers.aws`` against a
moto EC2 server, ``providers.gcp`` against :class:`tests.providers.fake_gce.FakeGce`); the user-data
script of every instance is the one :func:`providers.launch.cloud_init` wrote. :class:`InstanceEmulator`
watches the fake cloud and "boots" each new instance: it runs the instance's user-data script with
``bash`` as a local process, with

* fake ``docker``, ``aws``, ``gcloud`` and ``ip`` commands first on ``PATH`` (:func:`write_fake_tools`):
  ``docker run`` runs the container's command as a plain child process (no image, no isolation),
  ``aws s3 sync`` / ``gcloud storage rsync`` copy to and from a local directory standing for the
  object store (``s3://bucket/key`` and ``gs://bucket/key`` -> ``<workdir>/object-store/bucket/key``),
  ``ip`` reports a default route on ``ens5`` with the instance's private address;
* one :class:`FakeMetadata` server per instance (EC2 IMDSv2 and GCE metadata), whose spot /
  preemption notice a test raises with :meth:`InstanceEmulator.notice`;
* its own "local disk": the broker's checkpoint root in the script is rewritten to a directory of
  that instance only (``path_rewrite``), so checkpoints travel between instances only through the
  fake object store, as on a real cloud.

When the cloud shows an instance terminated (or it is gone), its script gets SIGTERM, as the
processes of a shutting-down machine do. The real ``curl`` and coreutils of this machine are used.

Layout under ``workdir``::

    bin/                    the fake tools
    object-store/BUCKET/... the object store, shared by every instance
    <instance id>/
        user-data.sh        the (rewritten) script
        console.log         its stdout and stderr (the instance's serial console)
        log/                FEDBROKER_LOG_DIR: the container's log (fedbroker-<job>-<attempt>-<rank>.log)
        docker/             FAKE_DOCKER_STATE: <container name>.pid while a container runs
        tmp/, home/         TMPDIR and HOME of the script

Times are in seconds throughout.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["write_fake_tools", "FakeMetadata", "InstanceEmulator", "InstanceState", "FAKE_TOOLS", "MANAGED_TAG"]

#: the commands :func:`write_fake_tools` writes
FAKE_TOOLS = ("docker", "aws", "gcloud", "ip")
#: tag (AWS) / label (GCP) key of instances managed by a broker (``providers.base.MANAGED_TAG``)
MANAGED_TAG = "fedbroker-broker"

# One Python program for every fake tool; it looks at the name it was called by.
_TOOLS_SRC = r'''
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

TOOL = os.path.basename(sys.argv[0])


def die(msg, code):
    print(f"{TOOL} (fake): {msg}", file=sys.stderr)
    sys.exit(code)


# ------------------------------------------------------------------------------------------- docker

RUN_FLAGS_NOARG = {"--rm", "--init", "--read-only"}
RUN_FLAGS_ARG = {"--name", "--gpus", "--network", "--net", "--ipc", "--ulimit", "--stop-timeout",
                 "-v", "--volume", "-e", "--env", "--cap-drop", "--security-opt", "--tmpfs", "--user"}


def state_dir():
    d = Path(os.environ.get("FAKE_DOCKER_STATE") or "/tmp/fake-docker-state")
    d.mkdir(parents=True, exist_ok=True)
    return d


def alive(pid):
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def write_pid(path, pid):
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def read_pid(path):
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def docker_run(args):
    name = None
    overlay, unset, mounts = {}, set(), []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-"):
            break
        flag, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if flag in RUN_FLAGS_NOARG and not eq:
            i += 1
            continue
        if flag not in RUN_FLAGS_ARG:
            die(f"docker run: unknown flag: {a}", 125)
        if not eq:
            if i + 1 >= len(args):
                die(f"docker run: flag needs an argument: {a}", 125)
            val = args[i + 1]
            i += 2
        else:
            i += 1
        if flag == "--name":
            name = val
        elif flag in ("-e", "--env"):
            key, has, value = val.partition("=")
            if has:
                overlay[key] = value
                unset.discard(key)
            elif key in os.environ:
                overlay[key] = os.environ[key]
                unset.discard(key)
            else:
                overlay.pop(key, None)
                unset.add(key)
        elif flag in ("-v", "--volume"):
            parts = val.split(":")
            if len(parts) < 2 or not parts[0] or not parts[1]:
                die(f"docker run: invalid volume specification: {val!r}", 125)
            mounts.append((parts[0], parts[1]))
    if i >= len(args):
        die("docker run: requires an image and a command", 125)
    image, cmd = args[i], args[i + 1:]
    if not cmd:
        die(f"docker run: {image}: the fake docker needs an explicit command", 125)
    env = dict(os.environ)
    env.update(overlay)
    for k in unset:
        env.pop(k, None)
    ckpt = env.get("CHECKPOINT_DIR")
    if ckpt is not None:
        for host, ctr in mounts:
            if ckpt.rstrip("/") == ctr.rstrip("/"):
                env["CHECKPOINT_DIR"] = host
                break
    name = name or f"fake-{uuid.uuid4().hex[:12]}"
    pidfile = state_dir() / f"{name}.pid"
    old = read_pid(pidfile)
    if old is not None and alive(old):
        die(f'Conflict. The container name "/{name}" is already in use', 125)
    # until the child runs, the pid file names this process: a stop in between is queued and forwarded
    pending, child = [], None

    def forward(sig, frame):
        if child is None:
            pending.append(sig)
        else:
            try:
                child.send_signal(sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    write_pid(pidfile, os.getpid())
    try:
        try:
            child = subprocess.Popen(cmd, env=env)
        except FileNotFoundError:
            die(f"exec: {cmd[0]!r}: executable file not found in $PATH", 127)
        except PermissionError:
            die(f"exec: {cmd[0]!r}: permission denied", 126)
        write_pid(pidfile, child.pid)
        for sig in pending:
            child.send_signal(sig)
        rc = child.wait()
    finally:
        if read_pid(pidfile) in (os.getpid(), getattr(child, "pid", None)):
            try:
                pidfile.unlink()
            except OSError:
                pass
    sys.exit(128 - rc if rc < 0 else rc)


def docker_stop(args):
    timeout, names, i = 10.0, [], 0
    while i < len(args):
        a = args[i]
        flag, eq, val = a.partition("=")
        if flag in ("-t", "--time", "--timeout"):
            if not eq:
                if i + 1 >= len(args):
                    die(f"docker stop: flag needs an argument: {a}", 125)
                val = args[i + 1]
                i += 1
            try:
                timeout = float(val)
            except ValueError:
                die(f"docker stop: invalid timeout {val!r}", 125)
        elif a.startswith("-"):
            die(f"docker stop: unknown flag: {a}", 125)
        else:
            names.append(a)
        i += 1
    if not names:
        die('"docker stop" requires at least 1 argument', 125)
    for name in names:
        pid = read_pid(state_dir() / f"{name}.pid")
        if pid is None or not alive(pid):
            print(f"Error response from daemon: No such container: {name}", file=sys.stderr)
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + max(timeout, 0.0)
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while alive(pid) and time.monotonic() < deadline + 5:
                time.sleep(0.05)
        print(name)
    sys.exit(0)


def docker(args):
    if not args:
        die("usage: docker info | run ... | stop [-t N] NAME", 1)
    if args[0] == "info":
        print("Server Version: fake (tests/e2e/cloudsim.py)")
        sys.exit(0)
    if args[0] == "run":
        docker_run(args[1:])
    if args[0] == "stop":
        docker_stop(args[1:])
    die(f"docker {args[0]}: not emulated", 1)


# ------------------------------------------------------------------------------- object-store sync

def store_path(uri, scheme):
    root = os.environ.get("FAKE_OBJECT_STORE")
    if not root:
        die("FAKE_OBJECT_STORE is not set", 2)
    parts = [p for p in uri[len(scheme):].split("/") if p]
    if not parts:
        die(f"{uri}: no bucket", 2)
    if any(p in (".", "..") for p in parts):
        die(f"{uri}: '.' or '..' in an object key", 2)
    return Path(root, *parts)


def location(arg, scheme):
    if arg.startswith(scheme):
        return store_path(arg, scheme), True
    if "://" in arg:
        die(f"{arg}: unsupported URL (only {scheme})", 2)
    return Path(arg), False


def sync(src, dst, recursive, quiet, labels):
    """Copy every file under ``src`` to ``dst`` (create, overwrite, never delete); a missing source is no error."""
    if not src.exists():
        return 0
    if not src.is_dir():
        die(f"{src}: not a directory", 2)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        if not recursive:
            dirnames.clear()
        dirnames.sort()
        for fn in sorted(filenames):
            if ".fake-sync-" in fn:
                continue  # another sync's temporary file
            target = dst / rel / fn
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{fn}.fake-sync-{os.getpid()}"
            shutil.copy2(Path(dirpath) / fn, tmp)
            os.replace(tmp, target)
            if not quiet:
                print(f"{labels}: {Path(dirpath) / fn} to {target}")
    return 0


def aws(args):
    if args[:2] != ["s3", "sync"]:
        die(f"aws {' '.join(args[:2])}: not emulated (only 's3 sync')", 2)
    quiet, pos = False, []
    for a in args[2:]:
        if a in ("--only-show-errors", "--quiet", "--no-progress"):
            quiet = True
        elif a in ("--exact-timestamps", "--size-only"):
            pass
        elif a.startswith("-"):
            die(f"aws s3 sync: option {a} is not emulated", 2)
        else:
            pos.append(a)
    if len(pos) != 2:
        die("aws s3 sync: needs SRC and DST", 2)
    (src, s_remote), (dst, d_remote) = location(pos[0], "s3://"), location(pos[1], "s3://")
    if not (s_remote or d_remote):
        die("aws s3 sync: one side must be s3://", 2)
    sys.exit(sync(src, dst, True, quiet, "upload" if d_remote else "download"))


def gcloud(args):
    quiet = "--quiet" in args or "-q" in args
    args = [a for a in args if a not in ("--quiet", "-q")]
    if args[:2] != ["storage", "rsync"]:
        die(f"gcloud {' '.join(args[:2])}: not emulated (only 'storage rsync')", 2)
    recursive, pos = False, []
    for a in args[2:]:
        if a in ("--recursive", "-r", "-R"):
            recursive = True
        elif a.startswith("-"):
            die(f"gcloud storage rsync: option {a} is not emulated", 2)
        else:
            pos.append(a)
    if len(pos) != 2:
        die("gcloud storage rsync: needs SOURCE and DESTINATION", 2)
    (src, s_remote), (dst, d_remote) = location(pos[0], "gs://"), location(pos[1], "gs://")
    sys.exit(sync(src, dst, recursive, quiet, "Copying"))


# ------------------------------------------------------------------------------------------------ ip

def ip(args):
    addr = os.environ.get("FAKE_PRIVATE_IP") or "10.0.0.2"
    net = addr.rsplit(".", 1)[0]
    words = [a for a in args if not a.startswith("-")]
    if words[:1] in (["route"], ["r"]) and "default" in words:
        print(f"default via {net}.1 dev ens5 proto dhcp src {addr} metric 100")
        sys.exit(0)
    if words[:1] in (["addr"], ["address"], ["a"]):
        dev = words[words.index("dev") + 1] if "dev" in words[:-1] else "ens5"
        if dev != "ens5":
            die(f'Device "{dev}" does not exist.', 1)
        print(f"2: ens5    inet {addr}/24 brd {net}.255 scope global ens5\\       "
              "valid_lft forever preferred_lft forever")
        sys.exit(0)
    die(f"ip {' '.join(args)}: not emulated", 1)


TOOLS = {"docker": docker, "aws": aws, "gcloud": gcloud, "ip": ip}
if TOOL not in TOOLS:
    die(f"unknown fake tool {TOOL!r}", 2)
TOOLS[TOOL](sys.argv[1:])
'''


def write_fake_tools(bin_dir: Path) -> None:
    """Write the fake ``docker``, ``aws``, ``gcloud`` and ``ip`` executables into ``bin_dir``.

    Each is a ``#!<this Python>`` script (standard library only) configured by environment variables:

    * ``docker info`` exits 0. ``docker run [--rm] [--name N] [--init] [--gpus X] [--network X]
      [--ipc X] [--ulimit X]... [--cap-drop X] [--security-opt X] [--read-only] [--tmpfs X] [--user X]
      [--stop-timeout N] [-v HOST:CTR]... [-e K=V | -e K]... IMAGE CMD...`` (the isolation flags are
      accepted and not enforced)
      runs ``CMD`` (an argv list, no shell; the image is ignored) as a child process, its environment
      the caller's overlaid with the ``-e`` values (a bare ``-e K`` copies ``K`` from the caller, or
      unsets it); a ``CHECKPOINT_DIR`` equal to the container side of a mount becomes the host side.
      The child's pid is in ``$FAKE_DOCKER_STATE/<name>.pid`` while it runs; SIGTERM/SIGINT are
      forwarded to it; the exit status is the child's, or 128 + signal number. Unknown flags: 125.
    * ``docker stop [-t N] NAME...``: SIGTERM to the container's process, SIGKILL after ``N`` seconds
      (default 10) if it still runs; exits 0, also for an unknown container.
    * ``aws s3 sync [--only-show-errors] SRC DST`` and ``gcloud storage rsync [--recursive] [--quiet]
      SRC DST``: ``s3://bucket/key`` / ``gs://bucket/key`` is ``$FAKE_OBJECT_STORE/bucket/key``;
      files are copied (directories created, files overwritten, nothing deleted; without
      ``--recursive`` gcloud copies only the top level); a missing source is no error. Any other
      ``aws`` / ``gcloud`` command exits 2.
    * ``ip -o -4 route show to default`` and ``ip -o -4 addr show dev ens5``: one line each, as on a
      cloud VM whose primary interface ``ens5`` has the address ``$FAKE_PRIVATE_IP``/24.
    """
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in FAKE_TOOLS:
        path = bin_dir / tool
        path.write_text(f"#!{sys.executable}\n# fake {tool}, written by tests/e2e/cloudsim.py\n" + _TOOLS_SRC)
        path.chmod(0o755)


# --------------------------------------------------------------------------------------- metadata

class FakeMetadata:
    """The instance metadata service of one emulated instance: EC2 IMDSv2 and GCE metadata at once.

    A ``ThreadingHTTPServer`` on ``127.0.0.1`` (a free port); :attr:`url` is ``http://127.0.0.1:PORT``,
    the value of ``FEDBROKER_IMDS_URL`` / ``FEDBROKER_GCE_METADATA_URL`` for the user-data script.

    * ``PUT /latest/api/token`` with header ``X-aws-ec2-metadata-token-ttl-seconds`` (1-21600) -> 200
      and a new session token (400 without the header).
    * ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token: <token>``:
      404 until :meth:`notice`, then 200 ``{"action": "terminate", "time": <notice time + 120 s,
      ISO 8601 UTC>}``; 401 without a valid token (as every ``/latest/meta-data/`` path).
      ``/latest/meta-data/local-ipv4`` and ``instance-id`` answer too.
    * ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: ``FALSE``
      until :meth:`notice`, then ``TRUE``; 403 without the header. ``.../network-interfaces/0/ip``
      and ``.../instance/name`` answer too.

    :attr:`requests` counts the requests per path (query strings dropped). Use as a context manager
    or :meth:`start` / :meth:`stop`.
    """

    #: seconds between an EC2 spot interruption notice and the interruption
    AWS_NOTICE_LEAD_S = 120

    def __init__(self, private_ip: str = "10.0.0.2", instance_id: str = "i-0000000000000000"):
        self.private_ip = private_ip
        self.instance_id = instance_id
        self.requests: Counter[str] = Counter()
        self.noticed_at: datetime | None = None
        self._tokens: set[str] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle

    def start(self) -> "FakeMetadata":
        """Start serving (in a daemon thread); returns ``self``."""
        md = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, body, headers = md.handle(method, self.path, self.headers)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", headers.pop("Content-Type", "text/plain"))
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                self._answer("GET")

            def do_PUT(self):
                self._answer("PUT")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"fake-metadata-{self.instance_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeMetadata":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (after :meth:`start`)."""
        assert self._server is not None, "FakeMetadata is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def notice(self) -> None:
        """Raise the spot interruption / preemption notice (from now on; it is never withdrawn)."""
        with self._lock:
            if self.noticed_at is None:
                self.noticed_at = datetime.now(timezone.utc)

    # ---- requests

    def handle(self, method: str, raw_path: str, headers: Any) -> tuple[int, str, dict[str, str]]:
        """``(status, body, headers)`` of one request (``headers``: a mapping with ``.get``)."""
        path = urlsplit(raw_path).path
        with self._lock:
            self.requests[path] += 1
            noticed = self.noticed_at
        if path.startswith("/latest/"):
            return self._aws(method, path, headers, noticed)
        if path.startswith("/computeMetadata/"):
            return self._gce(method, path, headers, noticed)
        return 404, "Not Found", {}

    def _aws(self, method: str, path: str, headers: Any, noticed: datetime | None) -> tuple[int, str, dict]:
        if path == "/latest/api/token":
            if method != "PUT":
                return 405, "Method Not Allowed", {}
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            try:
                ok = ttl is not None and 1 <= int(ttl) <= 21600
            except ValueError:
                ok = False
            if not ok:
                return 400, "Bad Request", {}
            token = secrets.token_urlsafe(32)
            with self._lock:
                self._tokens.add(token)
            return 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": str(int(ttl))}
        if method != "GET":
            return 405, "Method Not Allowed", {}
        with self._lock:
            valid = headers.get("X-aws-ec2-metadata-token") in self._tokens
        if not valid:
            return 401, "Unauthorized", {}
        if path == "/latest/meta-data/spot/instance-action":
            if noticed is None:
                return 404, "Not Found", {}
            at = (noticed + timedelta(seconds=self.AWS_NOTICE_LEAD_S)).strftime("%Y-%m-%dT%H:%M:%SZ")
            return 200, json.dumps({"action": "terminate", "time": at}), {"Content-Type": "application/json"}
        if path == "/latest/meta-data/local-ipv4":
            return 200, self.private_ip, {}
        if path == "/latest/meta-data/instance-id":
            return 200, self.instance_id, {}
        return 404, "Not Found", {}

    def _gce(self, method: str, path: str, headers: Any, noticed: datetime | None) -> tuple[int, str, dict]:
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", {}
        flavor = {"Metadata-Flavor": "Google"}
        if method != "GET":
            return 405, "Method Not Allowed", flavor
        if path == "/computeMetadata/v1/instance/preempted":
            return 200, "TRUE" if noticed is not None else "FALSE", flavor
        if path == "/computeMetadata/v1/instance/network-interfaces/0/ip":
            return 200, self.private_ip, flavor
        if path == "/computeMetadata/v1/instance/name":
            return 200, self.instance_id, flavor
        return 404, "Not Found", flavor


# --------------------------------------------------------------------------------------- emulator

_SAFE_PATH = re.compile(r"^[A-Za-z0-9_@%+=,./-]+$")  # characters shlex.quote leaves alone, no ':'
_AWS_LIVE = ("pending", "running")
_GCP_LIVE = ("PROVISIONING", "STAGING", "RUNNING")


@dataclass(frozen=True)
class InstanceState:
    """What the emulator knows of one booted instance.

    ``pid``: the user-data script's process (``None`` if the instance had no user data);
    ``returncode``: its exit status once it ended (negative = killed by that signal), else ``None``;
    ``terminated``: the cloud showed the instance terminated or gone and the script was sent SIGTERM.
    """

    instance_id: str
    provider: str
    zone: str
    private_ip: str
    pid: int | None
    returncode: int | None
    terminated: bool
    dir: Path
    console: Path
    metadata_url: str


class _Booted:
    def __init__(self, instance_id: str, zone: str, private_ip: str, dir: Path, metadata: FakeMetadata,
                 proc: subprocess.Popen | None):
        self.instance_id, self.zone, self.private_ip, self.dir = instance_id, zone, private_ip, dir
        self.metadata, self.proc = metadata, proc
        self.terminated = False


class InstanceEmulator:
    """Boots the instances of a local fake cloud as local processes running their user data.

    Args:
        workdir: directory for everything (see the module docstring for the layout).
        provider: ``"aws"`` (moto EC2: give ``ec2_endpoint_url`` and ``regions``) or ``"gcp"``
            (give ``fake_gce``, a started :class:`tests.providers.fake_gce.FakeGce`).
        ec2_endpoint_url: the EC2 endpoint (a moto server); clients use the credentials ``testing``.
        regions: AWS regions to watch (default ``["us-east-1"]``).
        fake_gce: the fake Compute Engine to watch.
        path_rewrite: ``(broker_checkpoint_root, local_root)``: every occurrence of the first string
            in a user-data script is replaced by ``local_root/<instance id>`` before it runs, so each
            instance has its own local disk. ``local_root`` may hold only the characters
            ``shlex.quote`` leaves alone (letters, digits, ``_@%+=,./-``) and no ``:``.
        broker_id: watch only instances whose ``fedbroker-broker`` tag / label has this value
            (default: every instance that has the tag / label).
        stop_grace_s: seconds :meth:`stop` gives the scripts after SIGTERM before SIGKILL.

    A *live* instance is one with the ``fedbroker-broker`` tag (AWS, state ``pending``/``running``)
    or label (GCP, status ``PROVISIONING``/``STAGING``/``RUNNING``). :meth:`poll_once` boots every
    live instance not booted yet, and sends SIGTERM to the script of every booted instance the
    cloud no longer shows live (AWS ``shutting-down``/``terminated``/``stopping``/``stopped``, GCP
    ``STOPPING``/``TERMINATED``/..., or gone). The private address is the cloud's (AWS
    ``PrivateIpAddress``, GCP ``networkInterfaces[0].networkIP``), else ``10.0.1.N``.

    :meth:`start` polls in a daemon thread; :meth:`stop` (or leaving the ``with`` block) ends it and
    every script. :attr:`errors` keeps the exceptions of failed polls.
    """

    def __init__(self, workdir: Path, provider: str, *, ec2_endpoint_url: str | None = None,
                 regions: list[str] | tuple[str, ...] | None = None, fake_gce: Any = None,
                 path_rewrite: tuple[str, str | Path] | None = None, broker_id: str | None = None,
                 stop_grace_s: float = 5.0):
        if provider not in ("aws", "gcp"):
            raise ValueError(f"provider={provider!r}: must be 'aws' or 'gcp'")
        if provider == "aws" and not ec2_endpoint_url:
            raise ValueError("provider='aws' needs ec2_endpoint_url")
        if provider == "gcp" and fake_gce is None:
            raise ValueError("provider='gcp' needs fake_gce")
        self.workdir = Path(workdir).resolve()
        self.provider = provider
        self.fake_gce = fake_gce
        self.regions = list(regions or ["us-east-1"])
        self.broker_id = broker_id
        self.stop_grace_s = stop_grace_s
        self.path_rewrite: tuple[str, Path] | None = None
        if path_rewrite is not None:
            old, local_root = path_rewrite
            local_root = Path(local_root).resolve()
            if not old or not _SAFE_PATH.match(str(local_root)):
                raise ValueError(f"path_rewrite={path_rewrite!r}: needs a non-empty root and a local root of "
                                 "letters, digits and _@%+=,./- only (it is put into shell-quoted words)")
            self.path_rewrite = (old, local_root)
        self.bin_dir = self.workdir / "bin"
        self.object_store = self.workdir / "object-store"
        self.errors: list[BaseException] = []
        self._booted: dict[str, _Booted] = {}
        self._ips = itertools.count(2)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clients: dict[str, Any] = {}
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.object_store.mkdir(exist_ok=True)
        write_fake_tools(self.bin_dir)
        if provider == "aws":
            import boto3

            for r in self.regions:
                self._clients[r] = boto3.client("ec2", region_name=r, endpoint_url=ec2_endpoint_url,
                                                aws_access_key_id="testing", aws_secret_access_key="testing")

    # ---- the fake cloud

    def _scan_aws(self) -> dict[str, dict[str, Any]]:
        """Every tagged instance: id -> {live, zone, ip, region}."""
        out: dict[str, dict[str, Any]] = {}
        flt = ({"Name": f"tag:{MANAGED_TAG}", "Values": [self.broker_id]} if self.broker_id is not None
               else {"Name": "tag-key", "Values": [MANAGED_TAG]})
        for region, ec2 in self._clients.items():
            for page in ec2.get_paginator("describe_instances").paginate(Filters=[flt]):
                for res in page.get("Reservations", []):
                    for i in res.get("Instances", []):
                        out[i["InstanceId"]] = {"live": i["State"]["Name"] in _AWS_LIVE, "region": region,
                                                "zone": i.get("Placement", {}).get("AvailabilityZone", region),
                                                "ip": i.get("PrivateIpAddress")}
        return out

    def _scan_gcp(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for inst in self.fake_gce.instances_in():
            labels = inst.get("labels") or {}
            if MANAGED_TAG not in labels or (self.broker_id is not None and labels[MANAGED_TAG] != self.broker_id):
                continue
            nics = inst.get("networkInterfaces") or [{}]
            items = (inst.get("metadata") or {}).get("items") or []
            script = next((i.get("value") for i in items if i.get("key") == "startup-script"), None)
            out[inst["name"]] = {"live": inst.get("status") in _GCP_LIVE, "zone": inst["zone"].rsplit("/", 1)[-1],
                                 "ip": nics[0].get("networkIP"), "user_data": script}
        return out

    def _user_data(self, instance_id: str, seen: dict[str, Any]) -> str | None:
        if self.provider == "gcp":
            return seen.get("user_data")
        attr = self._clients[seen["region"]].describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
        value = (attr.get("UserData") or {}).get("Value")
        return base64.b64decode(value).decode() if value else None

    # ---- booting and shutting down

    def _boot(self, instance_id: str, seen: dict[str, Any]) -> None:
        script = self._user_data(instance_id, seen)
        ip = seen.get("ip") or f"10.0.1.{next(self._ips)}"
        d = self.workdir / instance_id
        for sub in ("log", "docker", "tmp", "home"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        md = FakeMetadata(private_ip=ip, instance_id=instance_id).start()
        console = d / "console.log"
        proc = None
        if script is None:
            console.write_text("cloudsim: no user data\n")
        else:
            if self.path_rewrite is not None:
                script = script.replace(self.path_rewrite[0], str(self.path_rewrite[1] / instance_id))
            (d / "user-data.sh").write_text(script)
            env = {
                "PATH": f"{self.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": str(d / "home"),
                "LANG": "C.UTF-8",
                "TMPDIR": str(d / "tmp"),
                "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost",
                "FEDBROKER_IMDS_URL": md.url,
                "FEDBROKER_GCE_METADATA_URL": md.url,
                "FEDBROKER_LOG_DIR": str(d / "log"),
                "FAKE_PRIVATE_IP": ip,
                "FAKE_DOCKER_STATE": str(d / "docker"),
                "FAKE_OBJECT_STORE": str(self.object_store),
                "FAKE_INSTANCE_ID": instance_id,
            }
            with open(console, "ab") as out:
                proc = subprocess.Popen(["bash", "user-data.sh"], cwd=d, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._booted[instance_id] = _Booted(instance_id, seen.get("zone", ""), ip, d, md, proc)

    def poll_once(self) -> None:
        """Look at the fake cloud once: boot new live instances, SIGTERM the scripts of ended ones."""
        with self._lock:
            seen = self._scan_aws() if self.provider == "aws" else self._scan_gcp()
            for iid, info in seen.items():
                if info["live"] and iid not in self._booted:
                    self._boot(iid, info)
            for iid, b in self._booted.items():
                if b.terminated or (iid in seen and seen[iid]["live"]):
                    continue
                b.terminated = True
                if b.proc is not None and b.proc.poll() is None:
                    b.proc.send_signal(signal.SIGTERM)

    def _run(self, interval_s: float) -> None:
        while True:
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - keep polling; the test sees self.errors
                self.errors.append(e)
            if self._stop.wait(interval_s):
                return

    def start(self, interval_s: float = 0.3) -> "InstanceEmulator":
        """Call :meth:`poll_once` every ``interval_s`` seconds in a daemon thread; returns ``self``."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="cloudsim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; SIGTERM every script still running, SIGKILL (its whole process group) after
        :attr:`stop_grace_s` seconds; stop the metadata servers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            booted = list(self._booted.values())
            for b in booted:
                if b.proc is not None and b.proc.poll() is None:
                    b.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            for b in booted:
                if b.proc is None:
                    continue
                try:
                    b.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                try:  # the script, or what it left behind (containers, watchers)
                    os.killpg(b.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    b.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for b in booted:
                b.metadata.stop()

    def __enter__(self) -> "InstanceEmulator":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- looking at instances

    def notice(self, instance_id: str) -> None:
        """Raise the spot interruption (AWS) / preemption (GCP) notice on that instance's metadata."""
        self._get(instance_id).metadata.notice()

    def metadata(self, instance_id: str) -> FakeMetadata:
        """The metadata server of a booted instance."""
        return self._get(instance_id).metadata

    def _get(self, instance_id: str) -> _Booted:
        with self._lock:
            b = self._booted.get(instance_id)
        if b is None:
            raise KeyError(f"instance {instance_id!r} has not been booted by the emulator")
        return b

    def _state(self, b: _Booted) -> InstanceState:
        return InstanceState(instance_id=b.instance_id, provider=self.provider, zone=b.zone, private_ip=b.private_ip,
                             pid=b.proc.pid if b.proc else None, returncode=b.proc.poll() if b.proc else None,
                             terminated=b.terminated, dir=b.dir, console=b.dir / "console.log",
                             metadata_url=b.metadata.url if b.metadata._server else "")

    def instances(self) -> dict[str, InstanceState]:
        """Every booted instance: id -> :class:`InstanceState`."""
        with self._lock:
            return {iid: self._state(b) for iid, b in self._booted.items()}

    def console(self, instance_id: str) -> str:
        """The console output (script stdout + stderr) of an instance so far."""
        try:
            return (self._get(instance_id).dir / "console.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def local_dir(self, instance_id: str) -> Path:
        """``local_root/<instance id>``: that instance's local disk (``path_rewrite``)."""
        if self.path_rewrite is None:
            raise ValueError("no path_rewrite given")
        return self.path_rewrite[1] / instance_id

    def wait_booted(self, instance_id: str, timeout_s: float = 10.0) -> InstanceState:
        """Wait up to ``timeout_s`` seconds for the instance to be booted (polls itself unless
        :meth:`start` runs); ``AssertionError`` on timeout."""
        end = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if instance_id not in self._booted and self._thread is None:
                    self.poll_once()
                b = self._booted.get(instance_id)
                if b is not None:
                    return self._state(b)
            if time.monotonic() > end:
                raise AssertionError(f"instance {instance_id} not booted after {timeout_s} s; errors: {self.errors!r}")
            time.sleep(0.05)

    def wait(self, instance_id: str, timeout_s: float = 15.0) -> int:
        """Wait up to ``timeout_s`` seconds for the instance's script to end; its exit status.
        ``AssertionError`` (with the console) on timeout."""
        b = self._get(instance_id)
        if b.proc is None:
            raise ValueError(f"instance {instance_id} had no user data")
        try:
            return b.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"user data of {instance_id} still running after {timeout_s} s; console:\n"
                                 f"{self.console(instance_id)}") from None
