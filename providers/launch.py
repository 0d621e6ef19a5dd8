"""How one rank of a job attempt is started: one environment, one ``docker run``, one cloud-init script.

Every runtime gives the job the same environment, built once by :func:`job_environment`
from a :class:`LaunchSpec` (made by :func:`launch_spec`):

* the node agent's process runtime (:mod:`workers.agent`, through :func:`process_environment`),
* an on-prem container (:func:`docker_argv`),
* a cloud instance (:func:`cloud_init`: a ``#!/bin/bash`` user-data script that runs exactly
  the ``docker run`` of :func:`docker_argv`, every word passed through :func:`shlex.quote`:
  no user string reaches a shell unquoted).

The job's environment (``job_environment``), with the source each variable follows:

=========================  =====================================================================
``NODE_RANK``              rank of this node in the gang, 0-based (torchrun ``--node-rank``).
``NNODES``                 nodes in the gang (torchrun ``--nnodes``).
``GPUS_PER_NODE``          GPUs (processes) per node (torchrun ``--nproc-per-node``).
``WORLD_SIZE``             ``NNODES x GPUS_PER_NODE``: the global process count of
                           ``torch.distributed`` env:// initialisation (torchrun sets it again,
                           with the same value, for each worker it spawns).
``MASTER_ADDR``            rank 0's private address (env:// rendezvous, torchrun ``--master-addr``).
``MASTER_PORT``            :data:`RENDEZVOUS_PORT` 29500, the c10d default (torchrun ``--master-port``).
``PET_NNODES``,            the same values under torchrun's own environment names: every torchrun
``PET_NPROC_PER_NODE``,    option ``--x-y`` defaults to ``$PET_X_Y`` (``torch.distributed.argparse_util.env``),
``PET_NODE_RANK``,         so a bare ``torchrun train.py`` joins the gang (static rendezvous on
``PET_MASTER_ADDR``,       ``MASTER_ADDR:MASTER_PORT``).
``PET_MASTER_PORT``
``PET_RDZV_ID``            ``<job_id>-<attempt>``: the rendezvous id (torchrun ``--rdzv-id``), new per
                           attempt so a restarted gang never joins the previous attempt's rendezvous.
``FEDBROKER_JOB_ID``,      the job, the attempt (1, 2, ... after each requeue) and the node rank
``FEDBROKER_ATTEMPT``,     (the process runtime sets these three itself, with the same values).
``FEDBROKER_RANK``
``CHECKPOINT_DIR``         ``/checkpoints`` in a container (the host's per-job checkpoint directory,
                           ``<root>/<team>/<job_id>``, mounted there; it survives attempts); the host
                           directory itself in the process runtime (no mount there).
``NCCL_SOCKET_IFNAME``     the host's primary interface (the one of the IPv4 default route) when
                           known (NCCL environment variables: the interface NCCL's socket transport
                           and bootstrap use; without it NCCL may pick ``docker0`` or ``lo``). In
                           cloud-init it is computed at boot:
                           ``ip -o -4 route show to default | awk '{print $5}'``.
``NCCL_DEBUG``             ``WARN`` (NCCL environment variables: print NCCL warnings and errors, so a
                           failed rendezvous says why in the job's log).
=========================  =====================================================================

``CUDA_VISIBLE_DEVICES`` is not part of it: the process runtime sets it from the GPUs it was
given, and a container sees only the GPUs of ``--gpus`` (numbered from 0).

Nothing else reaches a job: no runtime passes on the environment of the process that launches
it (a node agent holds the broker's database URL and tokens). The process runtime starts the job
with exactly :func:`base_environment` (``PATH``, ``HOME`` = the attempt's working directory,
``LANG``, ``TZ``), then :func:`process_environment`, then its own ``CUDA_VISIBLE_DEVICES`` and
``FEDBROKER_JOB_ID``/``ATTEMPT``/``RANK``; a container gets the image's environment plus
:func:`job_environment` (``-e`` words only).

Cloud launches need the image pinned by digest (:func:`pin_image`): a tag can move between
rank 0's boot and rank 1's, and two ranks must run the same bits.

Bad arguments raise ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, replace
from typing import Callable, Iterable

__all__ = ["LaunchSpec", "launch_spec", "job_environment", "process_environment", "docker_argv", "container_name",
           "cloud_init", "pin_image", "default_route_interface", "RENDEZVOUS_PORT", "CONTAINER_CHECKPOINT_DIR",
           "DEFAULT_CHECKPOINT_ROOT", "PROVIDERS", "RUNTIME_OWNED_ENV", "SAFE_PATH", "base_environment",
           "PER_NODE_ENV", "scheduler_environment"]

#: torchrun/NCCL rendezvous port on rank 0 (the c10d default); the same as ``workers.agent.RENDEZVOUS_PORT``
RENDEZVOUS_PORT = 29500
#: where the job's checkpoint directory is mounted in its container
CONTAINER_CHECKPOINT_DIR = "/checkpoints"
DEFAULT_CHECKPOINT_ROOT = "/var/lib/fedbroker/checkpoints"
#: cloud providers :func:`cloud_init` writes a spot/preemption-notice watcher for
PROVIDERS = ("aws", "gcp")
#: keys the process runtime (:mod:`workers.runtime`) sets itself and refuses in ``env``
RUNTIME_OWNED_ENV = ("CUDA_VISIBLE_DEVICES", "FEDBROKER_JOB_ID", "FEDBROKER_ATTEMPT", "FEDBROKER_RANK")

#: ``PATH`` of a job started by the process runtime (not the agent's own ``PATH``)
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# the shell snippet of the brief: the interface of the IPv4 default route
_IFNAME_SNIPPET = "ip -o -4 route show to default | awk '{print $5}' | head -n 1"

# image reference, as broker.model.JobSpec checks it ([registry[:port]/]path[:tag][@sha256:digest])
_IMAGE_RE = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
_DIGEST_RE = DIGEST_RE = re.compile(r"@sha256:[a-f0-9]{64}$")  # an image reference pinned by digest
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # also a valid docker container name part
_TEAM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # broker.model's team names
_ADDR_RE = re.compile(r"^[A-Za-z0-9._:\[\]-]{1,255}$")  # host name, IPv4 or IPv6 address
_DOCKER_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$")
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:@=^,-]{1,255}$")  # NCCL_SOCKET_IFNAME syntax (prefix list, ^ = exclude)


def _int(field: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{field}={value!r}: must be an int {rng}")
    return value


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one rank of one job attempt on one host.

    ``gpu_devices``: host GPU indices for an on-prem container (``--gpus '"device=0,1"'``); empty =
    every GPU of the instance (cloud: the instance type is sized to the job). ``master_addr``: rank
    0's private address; ``master_port``: the rendezvous port (29500). ``nccl_socket_ifname``: the
    host's primary interface, ``None`` if not known here (cloud-init computes it at boot).
    ``checkpoint_dir``: absolute host path, mounted at ``/checkpoints``. ``grace_s``: seconds
    between SIGTERM and SIGKILL when the container is stopped (``docker stop -t``).

    Raises ``ValueError`` naming the field for any value out of range (see :func:`launch_spec`).
    """

    job_id: str
    attempt: int
    rank: int
    nnodes: int
    gpus_per_node: int
    image: str
    command: tuple[str, ...]
    gpu_devices: tuple[int, ...]
    master_addr: str
    master_port: int
    nccl_socket_ifname: str | None
    checkpoint_dir: str
    grace_s: int
    team: str

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not _JOB_ID_RE.match(self.job_id):
            raise ValueError(f"job_id={self.job_id!r}: 1-128 letters, digits, '.', '_' or '-' (starting alphanumeric)")
        _int("attempt", self.attempt, 0)
        _int("nnodes", self.nnodes, 1)
        _int("rank", self.rank, 0, self.nnodes - 1)
        _int("gpus_per_node", self.gpus_per_node, 1)
        if not isinstance(self.image, str) or not _IMAGE_RE.match(self.image):
            raise ValueError(f"image={self.image!r}: not a valid image reference")
        if isinstance(self.command, (str, bytes)):
            raise ValueError(f"command={self.command!r}: must be an argv list, not a string")
        cmd = tuple(self.command)
        if not cmd or not isinstance(cmd[0], str) or not cmd[0]:
            raise ValueError(f"command={list(cmd)!r}: needs at least a program name")
        for i, a in enumerate(cmd):
            if not isinstance(a, str) or "\x00" in a:
                raise ValueError(f"command[{i}]={a!r}: must be a str without NUL")
        object.__setattr__(self, "command", cmd)
        if isinstance(self.gpu_devices, (str, bytes)):
            raise ValueError(f"gpu_devices={self.gpu_devices!r}: must be a sequence of GPU indices")
        devs = tuple(self.gpu_devices)
        for i, g in enumerate(devs):
            _int(f"gpu_devices[{i}]", g, 0)
        if len(set(devs)) != len(devs):
            raise ValueError(f"gpu_devices={list(devs)!r}: repeats an index")
        if devs and len(devs) != self.gpus_per_node:
            raise ValueError(f"gpu_devices={list(devs)!r}: {len(devs)} GPUs for gpus_per_node={self.gpus_per_node}")
        object.__setattr__(self, "gpu_devices", devs)
        if not isinstance(self.master_addr, str) or not _ADDR_RE.match(self.master_addr):
            raise ValueError(f"master_addr={self.master_addr!r}: not a host name or IP address")
        _int("master_port", self.master_port, 1, 65535)
        if self.nccl_socket_ifname is not None and (not isinstance(self.nccl_socket_ifname, str)
                                                    or not _IFNAME_RE.match(self.nccl_socket_ifname)):
            raise ValueError(f"nccl_socket_ifname={self.nccl_socket_ifname!r}: not an interface name (list)")
        cd = self.checkpoint_dir
        if (not isinstance(cd, str) or not cd.startswith("/") or any(c in cd for c in "\x00\n\r")
                or "/../" in cd + "/"):
            raise ValueError(f"checkpoint_dir={cd!r}: must be an absolute path without '..', NUL or newline")
        _int("grace_s", self.grace_s, 0)
        if not isinstance(self.team, str) or not _TEAM_RE.match(self.team):
            raise ValueError(f"team={self.team!r}: 1-63 letters, digits, '.', '_' or '-'")

    @property
    def world_size(self) -> int:
        """Processes in the whole gang: ``nnodes x gpus_per_node``."""
        return self.nnodes * self.gpus_per_node


def launch_spec(job_spec, job_id: str, attempt: int, rank: int, nnodes: int, master_addr: str,
                gpu_devices: Iterable[int] = (), checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT,
                grace_s: float = 30, nccl_socket_ifname: str | None = None) -> LaunchSpec:
    """The :class:`LaunchSpec` of rank ``rank`` of attempt ``attempt`` of job ``job_id``.

    ``job_spec``: a :class:`broker.model.JobSpec` (image, command, gpus_per_node, team are read).
    The checkpoint directory is per job, ``{checkpoint_root}/{team}/{job_id}``: every attempt
    of the job sees the same one. ``grace_s`` (a number >= 0) is rounded up to whole seconds
    (``docker stop -t`` takes an integer). ``master_port`` is always :data:`RENDEZVOUS_PORT`.

    Raises ``ValueError`` naming the field (``nnodes`` different from ``job_spec.nodes``, a rank
    outside ``[0, nnodes)``, a GPU list of the wrong length, a relative ``checkpoint_root``, ...).
    """
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not math.isfinite(grace_s) or grace_s < 0:
        raise ValueError(f"grace_s={grace_s!r}: must be a finite number of seconds >= 0")
    nodes = getattr(job_spec, "nodes", None)
    if nodes is not None and nnodes != nodes:
        raise ValueError(f"nnodes={nnodes!r}: the job spec asks for nodes={nodes}")
    if not isinstance(checkpoint_root, str) or not checkpoint_root.startswith("/"):
        raise ValueError(f"checkpoint_root={checkpoint_root!r}: must be an absolute path")
    root = checkpoint_root.rstrip("/") or ""
    return LaunchSpec(
        job_id=job_id, attempt=attempt, rank=rank, nnodes=nnodes, gpus_per_node=job_spec.gpus_per_node,
        image=job_spec.image, command=tuple(job_spec.command), gpu_devices=tuple(gpu_devices),
        master_addr=master_addr, master_port=RENDEZVOUS_PORT, nccl_socket_ifname=nccl_socket_ifname,
        checkpoint_dir=f"{root}/{job_spec.team}/{job_id}", grace_s=math.ceil(grace_s), team=job_spec.team,
    )


def job_environment(ls: LaunchSpec) -> dict[str, str]:
    """The one environment every runtime gives the job (the table in the module docstring).

    ``NCCL_SOCKET_IFNAME`` is present only when ``ls.nccl_socket_ifname`` is known.
    ``CHECKPOINT_DIR`` is the container path ``/checkpoints`` (see :func:`process_environment`).
    """
    env = {
        "NODE_RANK": str(ls.rank),
        "NNODES": str(ls.nnodes),
        "GPUS_PER_NODE": str(ls.gpus_per_node),
        "WORLD_SIZE": str(ls.world_size),
        "MASTER_ADDR": ls.master_addr,
        "MASTER_PORT": str(ls.master_port),
        "PET_NNODES": str(ls.nnodes),
        "PET_NPROC_PER_NODE": str(ls.gpus_per_node),
        "PET_NODE_RANK": str(ls.rank),
        "PET_MASTER_ADDR": ls.master_addr,
        "PET_MASTER_PORT": str(ls.master_port),
        "PET_RDZV_ID": f"{ls.job_id}-{ls.attempt}",
        "FEDBROKER_JOB_ID": ls.job_id,
        "FEDBROKER_ATTEMPT": str(ls.attempt),
        "FEDBROKER_RANK": str(ls.rank),
        "CHECKPOINT_DIR": CONTAINER_CHECKPOINT_DIR,
        "NCCL_DEBUG": "WARN",
    }
    if ls.nccl_socket_ifname is not None:
        env["NCCL_SOCKET_IFNAME"] = ls.nccl_socket_ifname
    return env


def process_environment(ls: LaunchSpec) -> dict[str, str]:
    """:func:`job_environment` for the process runtime (no container): ``CHECKPOINT_DIR`` is the
    host directory ``ls.checkpoint_dir`` (nothing is mounted at ``/checkpoints``), and the keys
    the runtime sets itself (:data:`RUNTIME_OWNED_ENV`, same values) are left out."""
    env = {k: v for k, v in job_environment(ls).items() if k not in RUNTIME_OWNED_ENV}
    env["CHECKPOINT_DIR"] = ls.checkpoint_dir
    return env


#: keys whose value differs per node of a gang: an existing scheduler's job (one batch script for every node of the
#: allocation, ``providers.slurm``) sets them on each node itself (rank from ``SLURM_NODEID``, master from the
#: allocation's first node)
PER_NODE_ENV = ("NODE_RANK", "MASTER_ADDR", "PET_NODE_RANK", "PET_MASTER_ADDR", "FEDBROKER_RANK")


def scheduler_environment(ls: LaunchSpec) -> dict[str, str]:
    """:func:`process_environment` (the job runs on the scheduler's hosts, no container: ``CHECKPOINT_DIR`` is the
    host directory) less :data:`PER_NODE_ENV`, which the scheduler's job script sets on each node. ``ls.rank`` and
    ``ls.master_addr`` are not used."""
    return {k: v for k, v in process_environment(ls).items() if k not in PER_NODE_ENV}


def base_environment(home: str) -> dict[str, str]:
    """The minimal environment under every process-runtime job: ``PATH`` = :data:`SAFE_PATH`,
    ``HOME`` = ``home`` (the attempt's working directory), ``LANG=C.UTF-8``, ``TZ=UTC``.

    Raises ``ValueError`` naming ``home`` unless it is an absolute path without NUL.
    """
    if not isinstance(home, str) or not home.startswith("/") or "\x00" in home:
        raise ValueError(f"home={home!r}: must be an absolute path without NUL")
    return {"PATH": SAFE_PATH, "HOME": home, "LANG": "C.UTF-8", "TZ": "UTC"}


def container_name(ls: LaunchSpec) -> str:
    """``fedbroker-<job_id>-<attempt>-<rank>``: unique per rank of an attempt on a host."""
    return f"fedbroker-{ls.job_id}-{ls.attempt}-{ls.rank}"


def docker_argv(ls: LaunchSpec, passthrough: Iterable[str] = (), *, user: str | None = None,
                read_only: bool = True) -> list[str]:
    """The ``docker run`` argv (a list, never a shell string) that runs rank ``ls.rank``.

    ``passthrough``: environment keys whose value the launching shell provides (a bare ``-e KEY``
    instead of ``-e KEY=value``); cloud-init uses it for ``MASTER_ADDR``/``PET_MASTER_ADDR`` on
    rank 0, whose own address is only known at boot. Unknown keys raise ``ValueError``.
    ``user``: ``--user`` value (``name``, ``uid`` or ``uid:gid``; root and uid 0 are refused);
    ``None`` = the image's user. ``read_only``: ``--read-only`` root filesystem (default); pass
    ``False`` for an image that must write outside ``/tmp`` and ``/checkpoints``.

    Flags:

    * ``--rm``: remove the container when it exits (nothing of it outlives the attempt but the
      checkpoint directory);
    * ``--name fedbroker-<job>-<attempt>-<rank>``: a second start of the same rank fails instead
      of running twice, and ``docker stop`` finds it by name;
    * ``--init``: a tiny init (tini) as PID 1 forwards SIGTERM to the command; a command that is
      PID 1 itself and installs no handler would ignore SIGTERM and only die by SIGKILL;
    * ``--gpus '"device=0,1"'`` (the listed host GPUs; the inner quotes keep docker from reading
      the comma as a field separator) or ``--gpus all`` (every GPU of a cloud instance);
    * ``--network host`` only for a multi-node gang (``nnodes > 1``): the container uses the
      host's interfaces and address, so NCCL reaches the other ranks and rank 0's
      ``MASTER_ADDR:MASTER_PORT`` is the host's; a single-node job keeps docker's own network;
    * ``--cap-drop ALL --security-opt no-new-privileges``: no Linux capabilities, and no setuid
      binary can regain any;
    * ``--read-only --tmpfs /tmp:rw,nosuid,nodev`` (unless ``read_only=False``): the image's
      files cannot be changed; ``/tmp`` (in memory) and the checkpoint volume are the only
      writable places;
    * ``--user <user>`` when ``user`` is given;
    * ``--ipc host``: shared memory for NCCL's intra-node transport and PyTorch DataLoader workers
      (docker's default ``/dev/shm`` is 64 MB);
    * ``--ulimit memlock=-1``: unlimited locked memory (pinned buffers, InfiniBand/EFA registration);
    * ``--ulimit stack=67108864``: 64 MiB stack (NVIDIA's recommended settings for its
      framework containers);
    * ``--stop-timeout <grace_s>``: seconds between SIGTERM and SIGKILL when docker stops it;
    * ``-v <checkpoint_dir>:/checkpoints``: the job's checkpoint directory (survives attempts);
    * ``-e K=V`` for every variable of :func:`job_environment`; when the interface is not known
      here, a bare ``-e NCCL_SOCKET_IFNAME`` passes the launching shell's value through (docker
      sets nothing if that shell has none; cloud-init exports it at boot);
    * then the image and the command, as given (each one argv word).

    Tags are accepted (on-prem); cloud launches go through :func:`cloud_init`, which requires a digest.
    """
    if ":" in ls.checkpoint_dir:
        raise ValueError(f"checkpoint_dir={ls.checkpoint_dir!r}: docker -v cannot mount a path with ':'")
    gpus = f'"device={",".join(str(g) for g in ls.gpu_devices)}"' if ls.gpu_devices else "all"
    if user is not None and (not isinstance(user, str) or not _DOCKER_USER_RE.match(user)):
        raise ValueError(f"user={user!r}: must be a user name or uid, optionally ':group'")
    if user is not None and user.split(":")[0] in ("root", "0"):
        raise ValueError(f"user={user!r}: jobs never run as root (uid 0)")
    argv = ["docker", "run", "--rm", "--name", container_name(ls), "--init", "--gpus", gpus]
    if ls.nnodes > 1:
        argv += ["--network", "host"]
    argv += ["--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
             "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if read_only:
        argv += ["--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev"]
    if user is not None:
        argv += ["--user", user]
    argv += ["--stop-timeout", str(ls.grace_s), "-v", f"{ls.checkpoint_dir}:{CONTAINER_CHECKPOINT_DIR}"]
    env = job_environment(ls)
    bare = set(passthrough)
    if bare - set(env):
        raise ValueError(f"passthrough={sorted(bare)!r}: {sorted(bare - set(env))} not in the job environment")
    for k, v in env.items():
        argv += ["-e", k if k in bare else f"{k}={v}"]
    if ls.nccl_socket_ifname is None:
        argv += ["-e", "NCCL_SOCKET_IFNAME"]
    argv.append(ls.image)
    argv.extend(ls.command)
    return argv


def pin_image(image: str, resolve: Callable[[str], str] | None = None) -> str:
    """``image`` pinned by digest, as cloud launches require.

    An image with ``@sha256:<64 hex>`` is returned unchanged. Otherwise ``resolve(image)`` is
    called if given: it returns either the pinned reference (``repo[:tag]@sha256:...``) or the
    bare digest (``sha256:...``, appended to ``image``); the result is checked. Without a resolver
    raises ``ValueError("image=...: must be pinned by digest (@sha256:...) for cloud launches")``.
    """
    if not isinstance(image, str) or not _IMAGE_RE.match(image):
        raise ValueError(f"image={image!r}: not a valid image reference")
    if _DIGEST_RE.search(image):
        return image
    if resolve is None:
        raise ValueError(f"image={image!r}: must be pinned by digest (@sha256:...) for cloud launches")
    got = resolve(image)
    if isinstance(got, str) and got.startswith("sha256:"):
        got = f"{image}@{got}"
    if not isinstance(got, str) or not _IMAGE_RE.match(got) or not _DIGEST_RE.search(got):
        raise ValueError(f"image={image!r}: the resolver returned {got!r}, not a reference pinned by digest")
    return got


def default_route_interface(route_file: str = "/proc/net/route") -> str | None:
    """The interface of this host's IPv4 default route (Linux ``/proc/net/route``), ``None`` if
    there is none or the file cannot be read. The same choice as the cloud-init snippet
    ``ip -o -4 route show to default | awk '{print $5}'`` (lowest metric first)."""
    best: tuple[int, str] | None = None
    try:
        with open(route_file, encoding="ascii", errors="replace") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) < 8 or parts[1] != "00000000" or parts[7] != "00000000":
                    continue
                try:
                    flags, metric = int(parts[3], 16), int(parts[6])
                except ValueError:
                    continue
                if not flags & 0x1 or not _IFNAME_RE.match(parts[0]):  # RTF_UP
                    continue
                if best is None or metric < best[0]:
                    best = (metric, parts[0])
    except OSError:
        return None
    return best[1] if best else None


# ----------------------------------------------------------------------------- cloud-init

_AWS_WATCH = r"""# EC2 spot interruption notice (IMDSv2): instance-action answers 200 about 2 minutes before
spot_watch() {
  local token code
  while true; do
    token="$(curl -sf -m 2 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' "$IMDS_URL/latest/api/token")" || token=""
    code="$(curl -s -m 2 -o /dev/null -w '%{http_code}' -H "X-aws-ec2-metadata-token: ${token}" "$IMDS_URL/latest/meta-data/spot/instance-action")" || code=""
    if [ "$code" = "200" ]; then
      report notice "" "EC2 spot interruption notice"
      stop_container "EC2 spot interruption notice"
      return 0
    fi
    sleep "$NOTICE_POLL_S"
  done
}"""

_GCP_WATCH = r"""# GCE preemption notice: instance/preempted turns TRUE about 30 seconds before
spot_watch() {
  local v
  while true; do
    v="$(curl -sf -m 2 -H 'Metadata-Flavor: Google' "$GCE_METADATA_URL/computeMetadata/v1/instance/preempted")" || v=""
    if [ "$v" = "TRUE" ]; then
      report notice "" "GCE preemption notice"
      stop_container "GCE preemption notice"
      return 0
    fi
    sleep "$NOTICE_POLL_S"
  done
}"""

_WATCHERS = {"aws": _AWS_WATCH, "gcp": _GCP_WATCH}
#: metadata endpoints; the ``FEDBROKER_*`` variables only exist in tests (cloud-init runs user data with a bare environment)
_METADATA = {"aws": 'IMDS_URL="${FEDBROKER_IMDS_URL:-http://169.254.169.254}"',
             "gcp": 'GCE_METADATA_URL="${FEDBROKER_GCE_METADATA_URL:-http://metadata.google.internal}"'}
#: seconds between notice polls (AWS gives about 120 s of warning, GCP about 30 s)
_NOTICE_POLL_S = {"aws": 5, "gcp": 1}
#: object-store sync command per provider (the GPU machine image has the provider's CLI)
_SYNC = {"aws": "aws s3 sync --only-show-errors", "gcp": "gcloud storage rsync --recursive --quiet"}
_URI_SCHEME = {"aws": "s3://", "gcp": "gs://"}
_CKPT_URI_RE = re.compile(r"^(s3|gs)://[a-z0-9][a-z0-9._-]{1,62}(/[A-Za-z0-9._=-]+)*/?$")
_REPORT_URL_RE = re.compile(r"^https?://[A-Za-z0-9._:\[\]-]+(/[A-Za-z0-9._~/%-]*)?$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{16,128}$")
#: bytes of the container's log sent with the exit report
LOG_TAIL_BYTES = 65536


def cloud_init(ls: LaunchSpec, provider: str, resolve: Callable[[str], str] | None = None, *,
               report_url: str | None = None, report_token: str | None = None,
               checkpoint_uri: str | None = None, master_addr_at_boot: bool = False,
               checkpoint_sync_s: int = 300) -> str:
    """The ``#!/bin/bash`` user-data script that runs rank ``ls.rank`` on a ``provider`` instance.

    It installs nothing (the GPU machine image has docker, the NVIDIA container toolkit, curl and the
    provider's CLI), waits for the docker daemon, computes ``NCCL_SOCKET_IFNAME`` at boot when ``ls``
    does not know it (``ip -o -4 route show to default | awk '{print $5}'``), creates the checkpoint
    directory, then runs in the background exactly ``docker_argv(ls)`` (each word ``shlex.quote``-d;
    the image pinned by :func:`pin_image` first), its output appended to
    ``/var/log/fedbroker/<container>.log``, and waits for it. SIGTERM/SIGINT to the script and the
    provider's spot/preemption notice (polled: AWS IMDSv2 ``spot/instance-action`` every 5 s, GCP
    ``instance/preempted`` every 1 s) both run ``docker stop -t <grace_s>``: the job gets SIGTERM and
    ``grace_s`` seconds to checkpoint (GCP leaves about 30 s in all). The script exits with the
    container's status.

    Options (all values shell-quoted; bad ones raise ``ValueError`` naming the argument):

    * ``master_addr_at_boot``: rank 0's own address is not known when its instance is created, so
      the script sets ``MASTER_ADDR``/``PET_MASTER_ADDR`` to the IPv4 address of the default-route
      interface at boot (``ls.master_addr`` is then ignored) and passes them through
      (``docker_argv(ls, passthrough=...)``).
    * ``checkpoint_uri`` (``s3://bucket/prefix`` on AWS, ``gs://bucket/prefix`` on GCP): the
      checkpoint directory is restored from it before the container starts, pushed to it every
      ``checkpoint_sync_s`` seconds while it runs and once more after it exits (spot notice
      included), so the next attempt on another instance resumes from it (``aws s3 sync``,
      ``gcloud storage rsync``).
    * ``report_url`` + ``report_token``: the broker's instance report endpoint
      (``POST /v1/instances/report``, form fields ``job_id``, ``attempt``, ``rank``, ``event``,
      ``exit_code``, ``reason``, ``log_tail``, ``seq``; ``Authorization: Bearer <token>``; ``seq`` counts the
      rank's reports from 1, kept in a file under ``$TMPDIR``, the same for the retries of one report). Events:
      ``running`` (container started), ``notice`` (spot/preemption notice), ``exited`` (with the
      exit status and the last :data:`LOG_TAIL_BYTES` bytes of the log). Each is retried 5 times.

    Raises ``ValueError`` naming ``provider`` if it is not ``"aws"`` or ``"gcp"``, and
    :func:`pin_image`'s ``ValueError`` for an image not pinned by digest (without ``resolve``).
    """
    if provider not in _WATCHERS:
        raise ValueError(f"provider={provider!r}: unknown; cloud-init is written for {', '.join(PROVIDERS)}")
    if (report_url is None) != (report_token is None):
        raise ValueError(f"report_url={report_url!r}, report_token=...: give both or neither")
    if report_url is not None and not _REPORT_URL_RE.match(report_url):
        raise ValueError(f"report_url={report_url!r}: must be an http(s) URL without spaces or quotes")
    if report_token is not None and (not isinstance(report_token, str) or not _TOKEN_RE.match(report_token)):
        raise ValueError("report_token: 16-128 characters of A-Z a-z 0-9 _ -")
    if checkpoint_uri is not None and (not isinstance(checkpoint_uri, str) or not _CKPT_URI_RE.match(checkpoint_uri)
                                       or not checkpoint_uri.startswith(_URI_SCHEME[provider])):
        raise ValueError(f"checkpoint_uri={checkpoint_uri!r}: must be {_URI_SCHEME[provider]}bucket[/prefix] on {provider}")
    _int("checkpoint_sync_s", checkpoint_sync_s, 10)
    pinned = pin_image(ls.image, resolve)
    if pinned != ls.image:
        ls = replace(ls, image=pinned)
    q = shlex.quote
    passthrough = ("MASTER_ADDR", "PET_MASTER_ADDR") if master_addr_at_boot else ()
    log_file = f"{container_name(ls)}.log"
    docker_line = " ".join(q(a) for a in docker_argv(ls, passthrough))
    lines = [
        "#!/bin/bash",
        f"# fedbroker: job {ls.job_id} attempt {ls.attempt} rank {ls.rank} of {ls.nnodes} on {provider}.",
        "# Written by providers.launch: every value is shell-quoted (shlex.quote).",
        "set -u",
        'PATH="$PATH:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"',
        f"JOB_ID={q(ls.job_id)}",
        f"ATTEMPT={q(str(ls.attempt))}",
        f"RANK={q(str(ls.rank))}",
        f"CONTAINER={q(container_name(ls))}",
        f"GRACE_S={q(str(ls.grace_s))}",
        f"NOTICE_POLL_S={_NOTICE_POLL_S[provider]}",
        _METADATA[provider],
        'LOG_DIR="${FEDBROKER_LOG_DIR:-/var/log/fedbroker}"',
        f'LOG="$LOG_DIR/"{q(log_file)}',
        f"REPORT_URL={q(report_url or '')}",
        f"REPORT_TOKEN={q(report_token or '')}",
        f"CKPT_DIR={q(ls.checkpoint_dir)}",
        f"CKPT_URI={q(checkpoint_uri or '')}",
        'log() { echo "fedbroker-launch: $*" >&2; }',
        "# the report counter of this rank, in a file: reports from background subshells (spot_watch) share it;",
        "# the broker takes a report only if its seq is above the last one it took (replays change nothing)",
        'SEQ_FILE="${TMPDIR:-/tmp}/fedbroker-report-seq-$JOB_ID-$ATTEMPT-$RANK"',
        "next_seq() {",
        "  local n",
        '  { flock 9 2>/dev/null || true; n=$(( $(cat "$SEQ_FILE" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$SEQ_FILE"; } 9>>"$SEQ_FILE.lock"',
        '  echo "$n"',
        "}",
        "# report EVENT [EXIT_CODE] [REASON] [LOG_FILE]: tell the broker (5 tries, one seq)",
        "report() {",
        '  [ -n "$REPORT_URL" ] || return 0',
        "  local i args seq",
        '  seq="$(next_seq)"',
        '  args=(-sf -m 20 -o /dev/null -H "Authorization: Bearer $REPORT_TOKEN"',
        '        --data-urlencode "job_id=$JOB_ID" --data-urlencode "attempt=$ATTEMPT" --data-urlencode "rank=$RANK"',
        '        --data-urlencode "seq=$seq"',
        '        --data-urlencode "event=$1" --data-urlencode "exit_code=${2:-}" --data-urlencode "reason=${3:-}")',
        '  if [ -n "${4:-}" ] && [ -f "$4" ]; then args+=(--data-urlencode "log_tail@$4"); fi',
        "  for i in 1 2 3 4 5; do",
        '    curl "${args[@]}" "$REPORT_URL" && return 0',
        '    sleep "$i"',
        "  done",
        '  log "could not report $1 to the broker"',
        "}",
        "# checkpoint sync with the object store (restored before the container, pushed while and after it runs)",
        f"ckpt_pull() {{ [ -z \"$CKPT_URI\" ] || {_SYNC[provider]} \"$CKPT_URI\" \"$CKPT_DIR\" || log \"checkpoint restore failed\"; }}",
        f"ckpt_push() {{ [ -z \"$CKPT_URI\" ] || {_SYNC[provider]} \"$CKPT_DIR\" \"$CKPT_URI\" || log \"checkpoint upload failed\"; }}",
        "stop_container() {",
        '  log "$1: docker stop -t $GRACE_S $CONTAINER (SIGTERM, SIGKILL after ${GRACE_S}s)"',
        '  docker stop -t "$GRACE_S" "$CONTAINER" >/dev/null 2>&1 || true',
        "}",
        "trap 'stop_container \"received SIGTERM\"' TERM",
        "trap 'stop_container \"received SIGINT\"' INT",
        "if ! command -v docker >/dev/null 2>&1; then",
        '  log "docker is not installed on this machine image"',
        '  report exited 127 "docker is not installed on this machine image"',
        "  exit 127",
        "fi",
        "for _ in $(seq 1 90); do docker info >/dev/null 2>&1 && break; sleep 2; done",
    ]
    if ls.nccl_socket_ifname is None or master_addr_at_boot:
        lines += ["# the interface of the IPv4 default route: NCCL's socket transport and bootstrap use it",
                  f'BOOT_IFNAME="$({_IFNAME_SNIPPET})"']
    if ls.nccl_socket_ifname is None:
        lines += [
            'NCCL_SOCKET_IFNAME="$BOOT_IFNAME"',
            'if [ -n "$NCCL_SOCKET_IFNAME" ]; then',
            '  export NCCL_SOCKET_IFNAME; log "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME"',
            "else",
            '  unset NCCL_SOCKET_IFNAME; log "no IPv4 default route: NCCL picks its interface"',
            "fi",
        ]
    if master_addr_at_boot:
        lines += [
            "# rank 0 is the rendezvous endpoint: its own private address",
            'MASTER_ADDR="$(ip -o -4 addr show dev "${BOOT_IFNAME:-}" 2>/dev/null | awk \'{print $4}\' | cut -d/ -f1 | head -n 1)"',
            '[ -n "$MASTER_ADDR" ] || MASTER_ADDR="$(hostname -I 2>/dev/null | awk \'{print $1}\')"',
            'PET_MASTER_ADDR="$MASTER_ADDR"',
            'export MASTER_ADDR PET_MASTER_ADDR; log "MASTER_ADDR=$MASTER_ADDR"',
        ]
    lines += [
        'mkdir -p -- "$CKPT_DIR"',
        f'mkdir -p -- "$LOG_DIR" 2>/dev/null || {{ LOG_DIR="${{TMPDIR:-/tmp}}"; LOG="$LOG_DIR/"{q(log_file)}; }}',
        "ckpt_pull",
        _WATCHERS[provider],
        "# the job's container, in the background so the traps run while it does",
        docker_line + ' >>"$LOG" 2>&1 &',
        "DOCKER_PID=$!",
        "report running",
        "spot_watch &",
        "WATCH_PID=$!",
        f'( while sleep {checkpoint_sync_s}; do ckpt_push; done ) >>"$LOG_DIR/checkpoint-sync.log" 2>&1 &',
        "SYNC_PID=$!",
        "rc=0",
        "while true; do",
        '  wait "$DOCKER_PID"; rc=$?',
        '  kill -0 "$DOCKER_PID" 2>/dev/null && continue  # wait was cut short by a trap: wait again',
        "  # a trap may have cut wait short after the container ended: ask again for its own status",
        "  # (127 = already collected: rc is the container's)",
        '  if [ "$rc" -gt 128 ]; then wait "$DOCKER_PID" 2>/dev/null; r2=$?; [ "$r2" -ne 127 ] && rc=$r2; fi',
        "  break",
        "done",
        'for p in "$WATCH_PID" "$SYNC_PID"; do pkill -P "$p" 2>/dev/null; kill "$p" 2>/dev/null; done',
        'log "container $CONTAINER exited with status $rc"',
        "ckpt_push",
        f'tail -c {LOG_TAIL_BYTES} "$LOG" > "$LOG.tail" 2>/dev/null || true',
        'report exited "$rc" "" "$LOG.tail"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)
