"""Slurm pool adapter: an existing Slurm cluster as a place the broker runs jobs.

:class:`SlurmPool` drives the cluster through ``slurmrestd`` (REST, OpenAPI plugin ``v0.0.38``, a JWT per
request) when ``SlurmSettings.rest_url`` is set, else with the Slurm client commands (``sinfo``, ``sbatch``,
``scontrol``, ``squeue``, ``scancel``; ``sacct`` only for jobs ``scontrol`` no longer knows). Written against Slurm 22.05 (Debian 12 ``slurm-wlm`` 22.05.8); tested on a real
local cluster (``tests/slurm/cluster.py``).

Same small interface as the cloud adapters (``providers.base.Compute``), in a job's terms rather than an
instance's: :meth:`SlurmPool.capacity` (free GPUs per node by GPU type), :meth:`SlurmPool.submit`,
:meth:`SlurmPool.describe`, :meth:`SlurmPool.cancel`, :meth:`SlurmPool.list_managed` and
:meth:`SlurmPool.sweep`.

Submit (one ``sbatch`` per job attempt; a multi-node gang is one Slurm job)::

    --partition / --qos        settings.partition, settings.qos_by_class[priority_class] (if any)
    --nodes N --ntasks-per-node=1 --gpus-per-node=TYPE:COUNT     GPUs as GRES of the job's GPU type
    --time                     ceil((estimate_s * (1 + slack_frac) + slack_s) / 60) minutes, or the job's time_limit_s
    --deadline / --begin       the job's deadline / the start window the broker decided (cluster local time)
    --comment                  fedbroker-broker=B,fedbroker-job=J,fedbroker-attempt=N,fedbroker-team=T
    --job-name                 fb-J-aN;  --no-requeue: the broker, not Slurm, requeues an attempt (the REST path
                               cannot say it: slurmrestd v0.0.38 ignores ``requeue``; a job Slurm requeued
                               itself is reported ``interrupted`` and cancel/sweep still act on it)
    --output                   settings.log_dir/fedbroker-%j.out (a directory the compute nodes can write);
                               a gang's ranks: srun --output=settings.log_dir/fedbroker-%j-rank%t.out
    --export=NONE              the job starts with Slurm's SLURM_* only; sbatch itself runs in
                               :meth:`SlurmPool.client_environment` (nothing of the broker's), as the submit account

The batch script (:meth:`SlurmPool.batch_script`) sets ``PATH``, ``HOME``, ``LANG``, ``TZ``, the job environment
(``env``: the broker passes :func:`providers.launch.scheduler_environment`, the environment of every runtime less
what differs per node) and, for every job, ``MASTER_ADDR``/``PET_MASTER_ADDR`` (the first node of the
allocation), ``MASTER_PORT`` (29500, ``providers.launch.RENDEZVOUS_PORT``), ``NNODES``; a gang runs its command
once per node through ``srun --export=ALL`` with ``NODE_RANK``/``PET_NODE_RANK``/``FEDBROKER_RANK`` =
``SLURM_NODEID``. Who the job runs as, its output cap and its ``CHECKPOINT_DIR``: :class:`SlurmSettings`.

State mapping (Slurm job state -> the broker's lifecycle state, ``broker.states.JobState`` values)::

    PENDING, CONFIGURING(before start), RESV_DEL_HOLD        -> starting
    RUNNING, CONFIGURING, COMPLETING, SUSPENDED, STOPPED,
    SIGNALING, STAGE_OUT, RESIZING                           -> running
    COMPLETED                                                 -> succeeded (exit code 0)
    FAILED, TIMEOUT, DEADLINE, OUT_OF_MEMORY, BOOT_FAIL       -> failed (exit code, reason)
    CANCELLED                                                 -> cancelled; reason says whether the broker
                                                                 or the cluster (admin/owner) cancelled it
    NODE_FAIL, PREEMPTED, REQUEUED, REQUEUE_HOLD, REQUEUE_FED -> interrupted (the broker requeues the attempt)

Errors (``providers.base``; each with ``option = "slurm:<partition>:<gpu_type>"`` and ``code``)::

    SchedulerUnavailable   the client cannot reach slurmctld (or is not installed), or timed out
    Unsupported            no such partition; a GRES type (or more GPUs per node) no node of it has
    QuotaExceeded          over a partition limit (MaxTime, MaxNodes) or a QOS/association limit
    NoCapacity             ``submit(require_free=True)`` and not enough nodes have the GPUs free now
    ProviderError          anything else (``code="NotFound"`` for a job the cluster no longer knows)
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Mapping

from providers.base import (CANCEL_MARK, MANAGED_TAG, POOL_TERMINAL, NodeCapacity, NoCapacity, PoolJobInfo, PoolJobRequest,
                            ProviderError, QuotaExceeded, SchedulerUnavailable, Unsupported, pool_time_limit_s,
                            settings_from_section, free_gpus_of)
from providers.launch import DEFAULT_CHECKPOINT_ROOT, RENDEZVOUS_PORT, SAFE_PATH

__all__ = ["SlurmSettings", "SlurmJobRequest", "SlurmJobInfo", "NodeCapacity", "SlurmPool", "lifecycle_state",
           "time_limit_min", "parse_gres", "parse_scontrol", "CANCEL_MARK", "TERMINAL", "settings_from_mapping"]


_STARTING = {"PENDING", "RESV_DEL_HOLD"}
_RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
_FAILED = {"FAILED", "TIMEOUT", "DEADLINE", "OUT_OF_MEMORY", "BOOT_FAIL"}
_INTERRUPTED = {"NODE_FAIL", "PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
#: lifecycle states after which the attempt is over (``providers.base.POOL_TERMINAL``)
TERMINAL = POOL_TERMINAL

#: ``log_max_bytes`` default: 16 MiB per job output file (and per rank of a gang), as the agent's cap
#: (``broker.service.settings.BrokerSettings.log_max_bytes``); half is kept from the head, half from the tail
DEFAULT_LOG_MAX_BYTES = 16 * 1024 * 1024
MIN_LOG_MAX_BYTES, MAX_LOG_MAX_BYTES = 1024, 1 << 40
#: the GRES type :func:`parse_gres` gives an untyped ``gpu:N`` (``--gpus-per-node=N`` asks for it)
UNTYPED_GRES = "gpu"
#: job output files in ``log_dir``: the batch script's (a single-node job's output; a gang's ``srun`` messages)
#: and, for a gang, one per node rank (``%t``, the task id: one task per node, so the node rank)
BATCH_LOG = "fedbroker-%j.out"
RANK_LOG = "fedbroker-%j-rank%t.out"
_LOG_FILE_RE = re.compile(r"fedbroker-(\d+)(?:-rank(\d+))?\.out")
#: a SIGTERM before the command started ends the (batch or rank) shell by that signal (the command would not get it)
_TERM_BEFORE = "trap 'trap - TERM; kill -s TERM $$' TERM"
#: the variables Slurm itself gives a job that the batch script keeps (a bash ``case`` pattern); every other one
#: is unset before the job environment is set
_SLURM_ENV = ("SLURM*|CUDA_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|ROCR_VISIBLE_DEVICES|ZE_AFFINITY_MASK|TMPDIR|"
              "ENVIRONMENT|HOSTNAME")
_USER_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")

_UNAVAILABLE = ("unable to contact slurm controller", "connection refused", "socket timed out",
                "zero bytes were transmitted", "communication connection failure", "slurm_conf",
                "could not establish a configuration source", "munge", "authentication")
_UNSUPPORTED = ("invalid partition", "requested node configuration is not available",
                "invalid generic resource", "invalid gres", "invalid qos specification", "invalid account")
_LIMITS = ("requested time limit is invalid", "node count specification invalid", "job violates accounting",
           "qosmax", "assocmax", "partition configuration not available", "more processors requested than permitted",
           "exceeds some limit", "qos", "memory required by task is not available")


@dataclass(frozen=True)
class SlurmSettings:
    """How to reach one Slurm cluster and how to submit to it.

    ``partition`` the partition jobs go to; ``broker_id`` the value of the ``fedbroker-broker`` tag;
    ``log_dir`` where job output goes (must be writable on the compute nodes: a shared file system);
    ``slurm_conf`` the ``SLURM_CONF`` path for the clients (``None``: the client's default);
    ``bin_dir`` where the Slurm commands are (``None``: ``PATH``); ``slack_frac`` and ``slack_s`` the time-limit
    slack over the estimate (fraction, s); ``term_grace_s`` seconds between SIGTERM and the kill on cancel;
    ``qos_by_class`` priority class -> QOS name; ``timeout_s`` per client command (s); ``wckey`` a WCKey
    put on every job (the cluster must have ``TrackWCKey`` and accounting; ``None``: none).

    Who the jobs run as (:meth:`SlurmPool.submit_account`): ``submit_user`` the Slurm account jobs are submitted
    as and run as. CLI path: the broker runs ``sbatch`` as that user (it must run as root to switch, or be that
    user); ``None``: the broker's own user. REST path: the JWT's user ``rest_user`` (``submit_user``, if given,
    must be the same). Refused unless ``allow_privileged_submit``: root, the cluster's ``SlurmUser``, and (CLI
    path) the broker's own user, which can read the broker's settings and state.

    ``log_dir`` must be owned by that account, mode 0700 (the broker creates it so, or tightens the mode, where
    its host sees it); each job's output file there is made 0600 and capped at ``log_max_bytes`` bytes per file
    (its first half and its last half are kept, with a line saying how many bytes were dropped between; 1 KiB to
    1 TiB, default 16 MiB, the agent's cap). ``checkpoint_root``: the shared directory (every node sees it, the
    account can write it) under which each job's ``CHECKPOINT_DIR`` ``<root>/<team>/<job>`` is made, mode 0700,
    owned by the account. ``gres_types``: GRES type name -> GPU type of the power table for GRES the planner
    cannot read as a GPU type, e.g. ``{gpu: A100}`` for an untyped ``gpu:4``.
    """

    partition: str = "gpu"
    broker_id: str = "fedbroker"
    log_dir: str = "/var/lib/fedbroker/slurm-logs"
    slurm_conf: str | None = None
    bin_dir: str | None = None
    slack_frac: float = 0.2
    slack_s: float = 300.0
    term_grace_s: float = 30.0
    qos_by_class: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0
    wckey: str | None = None
    rest_url: str | None = None
    jwt_file: str | None = None
    rest_user: str | None = None
    rest_version: str = "v0.0.38"
    submit_user: str | None = None
    allow_privileged_submit: bool = False
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES
    checkpoint_root: str = DEFAULT_CHECKPOINT_ROOT
    gres_types: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.partition):
            raise ValueError(f"partition={self.partition!r}: must be 1-64 of A-Z a-z 0-9 _ . -")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.broker_id):
            raise ValueError(f"broker_id={self.broker_id!r}: must be 1-64 of A-Z a-z 0-9 _ . -")
        for name in ("slack_frac", "slack_s", "term_grace_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0")
        if not (self.timeout_s > 0):
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be > 0")
        if self.rest_url is not None:
            if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", self.rest_url):
                # a URL with user:password@ is not echoed (the error reaches stderr and logs; providers cannot use
                # broker.service.redact); slurmrestd takes the JWT of jwt_file, never userinfo
                shown = "<hidden: holds user:password@>" if "@" in self.rest_url else repr(self.rest_url)
                raise ValueError(f"rest_url={shown}: must be an http(s) URL")
            if not self.jwt_file or not self.rest_user:
                raise ValueError("rest_url is set: jwt_file and rest_user are required (the JWT and its user)")
            if self.submit_user is not None and self.submit_user != self.rest_user:
                raise ValueError(f"submit_user={self.submit_user!r}: on the REST path jobs run as the JWT's user "
                                 f"(rest_user={self.rest_user!r}); leave submit_user out or make them the same")
        for name in ("submit_user", "rest_user"):
            v = getattr(self, name)
            if v is not None and not _USER_RE.fullmatch(v):
                raise ValueError(f"{name}={v!r}: must be a user name (1-32 of a-z A-Z 0-9 _ . -, not starting with -)")
        if isinstance(self.log_max_bytes, bool) or not isinstance(self.log_max_bytes, int) or \
                not MIN_LOG_MAX_BYTES <= self.log_max_bytes <= MAX_LOG_MAX_BYTES:
            raise ValueError(f"log_max_bytes={self.log_max_bytes!r}: must be an integer from {MIN_LOG_MAX_BYTES} to "
                             f"{MAX_LOG_MAX_BYTES} bytes")
        for name in ("log_dir", "checkpoint_root"):
            v = getattr(self, name)
            if not isinstance(v, str) or not re.fullmatch(r"/[A-Za-z0-9_.,+@%/-]*", v):
                raise ValueError(f"{name}={v!r}: must be an absolute path of A-Z a-z 0-9 _ . , + @ % / -")
        for gres, gpu in self.gres_types.items():
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", gres) or not re.fullmatch(r"[A-Za-z0-9_. -]{1,64}", gpu):
                raise ValueError(f"gres_types: {gres!r}: {gpu!r}: a GRES type name (1-64 of A-Z a-z 0-9 _ . -) -> a "
                                 "GPU type name (e.g. gpu: A100)")


def settings_from_mapping(section: Mapping, where: str = "slurm") -> SlurmSettings:
    """:class:`SlurmSettings` from one pool's section of a settings file (YAML/JSON mapping). ``ValueError`` naming
    ``where`` and the key for an unknown key or a value of the wrong type (the checks of :class:`SlurmSettings`
    name the field for a bad value); ``providers.base.settings_from_section``."""
    return settings_from_section(SlurmSettings, section, where, {
        "slack_frac": "number", "slack_s": "number", "term_grace_s": "number", "timeout_s": "number",
        "qos_by_class": "str_map", "allow_privileged_submit": "bool", "log_max_bytes": "int", "gres_types": "str_map"})


#: the job attempt request of every pool kind (``providers.base.PoolJobRequest``)
SlurmJobRequest = PoolJobRequest


@dataclass(frozen=True)
class SlurmJobInfo(PoolJobInfo):
    """What the cluster says about one job (``providers.base.PoolJobInfo``: ``pool_job_id`` the Slurm job id,
    ``pool_state`` Slurm's own job state, ``stdout`` the log path, ``exit_code``/``signal`` Slurm's
    ``ExitCode=code:signal``). ``slurm_job_id``, ``slurm_state`` and ``slurm_active`` name the same fields."""

    @property
    def slurm_job_id(self) -> str:
        """The Slurm job id (``pool_job_id``)."""
        return self.pool_job_id

    @property
    def slurm_state(self) -> str:
        """Slurm's job state (``pool_state``)."""
        return self.pool_state

    @property
    def slurm_active(self) -> bool:
        """Slurm still queues or runs the job (``active``; true of a job Slurm requeued itself, whose attempt is
        over)."""
        return self.active


def _slurm_active(slurm_state: str) -> bool:
    return slurm_state in _STARTING or slurm_state in _RUNNING


def time_limit_min(estimate_s: float, slack_frac: float, slack_s: float, time_limit_s: float | None = None) -> int:
    """``--time`` in whole minutes: ``ceil((estimate_s * (1 + slack_frac) + slack_s) / 60)``, at least 1, or the
    job's own ``time_limit_s`` rounded up to minutes (:func:`providers.base.pool_time_limit_s`).
    E.g. 600 s with 20 % and 300 s slack -> ceil(1020 / 60) = 17 min; ``time_limit_s=90`` -> 2 min."""
    return max(1, math.ceil(pool_time_limit_s(estimate_s, slack_frac, slack_s, time_limit_s) / 60.0))


def parse_gres(text: str) -> dict[str, int]:
    """GPU count per type from a GRES string: ``gpu:a100:2(S:0-1),gpu:v100:1`` -> ``{"a100": 2, "v100": 1}``;
    ``gpu:4`` -> ``{"gpu": 4}``; ``gpu:a100:1(IDX:0)`` (GresUsed) -> ``{"a100": 1}``; ``(null)`` -> ``{}``.
    Other GRES (``shard``, ``mps``) are left out."""
    out: dict[str, int] = {}
    for part in re.split(r",(?![^(]*\))", text.strip()):
        part = re.sub(r"\(.*?\)", "", part).strip()
        bits = part.split(":")
        if not bits or bits[0] != "gpu" or len(bits) < 2:
            continue
        if len(bits) == 2:
            typ, cnt = "gpu", bits[1]
        else:
            typ, cnt = bits[1], bits[2]
        if cnt.isdigit():
            out[typ] = out.get(typ, 0) + int(cnt)
    return out


_KV_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_scontrol(line: str) -> dict[str, str]:
    """``scontrol -o show ...`` one-line output -> ``{key: value}`` (a value runs up to the next `` Key=``)."""
    keys = list(_KV_RE.finditer(line))
    out = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def _duration_s(text: str | None) -> float | None:
    """Slurm's ``[D-]HH:MM:SS`` / ``MM:SS`` -> seconds; ``None`` for ``UNLIMITED``, ``N/A``, ``INVALID``."""
    if not text or not re.fullmatch(r"(\d+-)?\d+(:\d+){1,2}", text):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(x) for x in text.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return float(days * 86400 + h * 3600 + m * 60 + s)


def parse_tags(comment: str) -> dict[str, str]:
    """The ``key=value,...`` tags of a job's comment (``(null)`` or free text -> ``{}``)."""
    out = {}
    for part in (comment or "").split(","):
        k, sep, v = part.partition("=")
        if sep and k.strip():
            out[k.strip()] = v.strip()
    return out


def lifecycle_state(slurm_state: str) -> str:
    """The broker lifecycle state for Slurm's job state (module docstring); ``ValueError`` for an unknown one."""
    s = slurm_state.split()[0].rstrip("+") if slurm_state else ""
    if s in _STARTING:
        return "starting"
    if s in _RUNNING:
        return "running"
    if s == "COMPLETED":
        return "succeeded"
    if s in _FAILED:
        return "failed"
    if s == "CANCELLED":
        return "cancelled"
    if s in _INTERRUPTED:
        return "interrupted"
    raise ValueError(f"slurm_state={slurm_state!r}: not a Slurm job state")


Runner = Callable[..., subprocess.CompletedProcess]


class SlurmPool:
    """An existing Slurm cluster (one partition) as a broker pool; see the module docstring.

    ``runner(argv, input=None, timeout=None, env=None) -> CompletedProcess`` runs one client command (default
    :func:`subprocess.run`); tests may inject one.
    """

    name = "slurm"

    def __init__(self, settings: SlurmSettings, runner: Runner | None = None):
        self.settings = settings
        self._runner = runner
        self._account: tuple[str, int | None, int | None] | None = None

    # ---------------------------------------------------------------- plumbing
    def _option(self, gpu_type: str = "*") -> str:
        return f"slurm:{self.settings.partition}:{gpu_type}"

    def client_environment(self) -> dict[str, str]:
        """The environment of every Slurm client command the adapter runs (and so of ``sbatch``): ``PATH``
        (:data:`providers.launch.SAFE_PATH`, ``bin_dir`` first when set), ``LANG=C.UTF-8``, the broker's ``TZ``
        when it has one (``--deadline`` is sent in local time) and ``SLURM_CONF`` when set; none of the broker's
        own variables (its database URL, cloud keys, tokens)."""
        import os

        s = self.settings
        env = {"PATH": f"{s.bin_dir}:{SAFE_PATH}" if s.bin_dir else SAFE_PATH, "LANG": "C.UTF-8"}
        if os.environ.get("TZ"):
            env["TZ"] = os.environ["TZ"]
        if s.slurm_conf:
            env["SLURM_CONF"] = s.slurm_conf
        return env

    def _run(self, *argv: str, input: str | None = None, option: str | None = None,
             check: bool = True, as_account: bool = False) -> subprocess.CompletedProcess:
        """One client command, in :meth:`client_environment`, from ``/``; ``as_account``: as the submit account
        (:meth:`submit_account`: ``user``/``group``/``extra_groups=[]`` of :func:`subprocess.run` when the broker
        is root and the account is another user)."""
        import os

        s = self.settings
        exe = str(Path(s.bin_dir) / argv[0]) if s.bin_dir else argv[0]
        run = self._runner or subprocess.run
        kw: dict = {}
        if as_account:
            _, uid, gid = self.submit_account()
            if uid is not None and uid != os.geteuid():
                kw = {"user": uid, "group": gid, "extra_groups": []}
        try:
            r = run([exe, *argv[1:]], input=input, capture_output=True, text=True, timeout=s.timeout_s,
                    env=self.client_environment(), cwd="/", **kw)
        except FileNotFoundError:
            raise SchedulerUnavailable(f"{argv[0]}: not found (is the Slurm client installed? bin_dir={s.bin_dir!r})",
                                       option or self._option(), "ClientMissing") from None
        except subprocess.TimeoutExpired:
            raise SchedulerUnavailable(f"{argv[0]}: no answer in {s.timeout_s} s", option or self._option(),
                                       "Timeout") from None
        if check and r.returncode != 0:
            raise self._error(argv[0], r.stderr.strip() or r.stdout.strip(), option or self._option())
        return r

    def _rest(self, method: str, path: str, body: dict | None = None, option: str | None = None) -> dict:
        """One ``slurmrestd`` request (JWT in ``X-SLURM-USER-TOKEN``); the answer's ``errors`` and HTTP status
        mapped onto the typed errors (5xx, 401/403, no answer, no token file -> :class:`SchedulerUnavailable`)."""
        import requests

        s = self.settings
        option = option or self._option()
        try:
            tok = Path(s.jwt_file or "").read_text().strip()
        except OSError as e:
            raise SchedulerUnavailable(f"jwt_file={s.jwt_file!r}: cannot read the token ({e})", option, "NoToken") from None
        tok = tok.split("=", 1)[1] if tok.startswith("SLURM_JWT=") else tok
        url = f"{(s.rest_url or '').rstrip('/')}/slurm/{s.rest_version}/{path}"
        headers = {"X-SLURM-USER-NAME": s.rest_user or "", "X-SLURM-USER-TOKEN": tok}
        try:
            r = requests.request(method, url, json=body, headers=headers, timeout=s.timeout_s)
        except requests.Timeout:
            raise SchedulerUnavailable(f"slurmrestd {method} {path}: no answer in {s.timeout_s} s", option,
                                       "Timeout") from None
        except requests.RequestException as e:
            raise SchedulerUnavailable(f"slurmrestd {method} {path}: {e}", option, "SchedulerUnavailable") from None
        if r.status_code in (401, 403):
            raise SchedulerUnavailable(f"slurmrestd {method} {path}: HTTP {r.status_code} (JWT missing or refused)",
                                       option, "Unauthorized")
        try:
            data = r.json()
        except ValueError:
            data = {}
        errs = data.get("errors") or [] if isinstance(data, dict) else []
        if errs:
            msg = "; ".join(" ".join(str(e.get(k, "")) for k in ("error", "description") if e.get(k)) for e in errs)
            if msg.strip() == "Unspecified error":
                raise SchedulerUnavailable(f"slurmrestd {method} {path}: 'Unspecified error' (slurmctld refused the "
                                           "request: an expired or invalid JWT answers this)", option, "AuthRejected")
            err = self._error("slurmrestd", msg, option)
            if type(err) is ProviderError and err.code is None and r.status_code >= 500:
                raise SchedulerUnavailable(str(err), option, f"HTTP{r.status_code}")
            raise err
        if r.status_code >= 500 or not isinstance(data, dict):
            raise SchedulerUnavailable(f"slurmrestd {method} {path}: HTTP {r.status_code}", option,
                                       f"HTTP{r.status_code}")
        if r.status_code >= 400:
            raise ProviderError(f"slurmrestd {method} {path}: HTTP {r.status_code}", option, f"HTTP{r.status_code}")
        return data

    @staticmethod
    def _error(cmd: str, msg: str, option: str) -> ProviderError:
        low = msg.lower()
        text = f"{cmd}: {msg}"
        if any(k in low for k in _UNAVAILABLE):
            return SchedulerUnavailable(text, option, "SchedulerUnavailable")
        if any(k in low for k in _UNSUPPORTED):
            return Unsupported(text, option, "Unsupported")
        if any(k in low for k in _LIMITS):
            return QuotaExceeded(text, option, "PartitionLimit")
        if "invalid job id" in low:
            return ProviderError(text, option, "NotFound")
        return ProviderError(text, option)

    # ---------------------------------------------------------------- who jobs run as
    def slurm_user(self) -> str | None:
        """The cluster's ``SlurmUser`` (``scontrol show config``; the name without its ``(uid)``); ``None`` on the
        REST path (slurmrestd v0.0.38 does not serve the configuration) or when the client cannot say."""
        if self.settings.rest_url:
            return None
        r = self._run("scontrol", "show", "config", check=False)
        m = re.search(r"^SlurmUser\s*=\s*([^\s(]+)", r.stdout or "", re.M)
        return m.group(1) if r.returncode == 0 and m else None

    def submit_account(self) -> tuple[str, int | None, int | None]:
        """``(user name, uid, gid)`` of the Slurm account this pool's jobs are submitted as and run as
        (:class:`SlurmSettings`: ``submit_user``, ``rest_user`` or the broker's own user; uid/gid ``None`` when
        this host has no such user, the REST path only). Checked once, then kept.

        Raises :class:`providers.base.Unsupported` (``code="PrivilegedSubmit"``) for root, the cluster's
        ``SlurmUser`` (CLI path: ``scontrol show config``) or (CLI path) the broker's own user unless
        ``allow_privileged_submit``; ``code="NoSuchUser"``
        for a ``submit_user`` this host does not know (CLI path), ``code="CannotSwitchUser"`` when the broker is
        neither root nor that user."""
        import os
        import pwd

        if self._account is not None:
            return self._account
        s = self.settings
        me = os.geteuid()
        try:
            my_name = pwd.getpwuid(me).pw_name
        except KeyError:
            my_name = str(me)
        name = s.rest_user if s.rest_url else (s.submit_user or my_name)
        try:
            pw = pwd.getpwnam(name)
            uid, gid = pw.pw_uid, pw.pw_gid
        except KeyError:
            if not s.rest_url:
                raise Unsupported(f"submit_user={name!r}: no such user on the broker's host", self._option(),
                                  "NoSuchUser") from None
            uid = gid = None
        if not s.rest_url and uid != me and me != 0:
            raise Unsupported(f"submit_user={name!r}: the broker runs as {my_name!r}, not root, and cannot submit as "
                              "another user (run the broker as root, or as that user)", self._option(),
                              "CannotSwitchUser")
        why = None
        slurm_user = None if s.rest_url else self.slurm_user()
        if uid == 0 or name == "root":
            why = "root"
        elif name == slurm_user:
            why = "the cluster's SlurmUser"
        elif not s.rest_url and uid == me:
            why = "the broker's own user (its jobs could read the broker's settings and state)"
        if why and not s.allow_privileged_submit:
            key = "rest_user" if s.rest_url else "submit_user"
            raise Unsupported(f"{key}={name!r} is {why}: jobs of other teams would run with its rights; set {key} to "
                              "an unprivileged Slurm account, or allow_privileged_submit: true to accept this",
                              self._option(), "PrivilegedSubmit")
        if s.rest_url or slurm_user is not None:  # kept once SlurmUser is known (checked again while it is not)
            self._account = (name, uid, gid)
        return name, uid, gid

    def prepare_directories(self, create: bool = True) -> None:
        """Make ``log_dir`` and ``checkpoint_root`` ready where this host sees them: a missing one is created mode
        0700 and given to the submit account (when the broker is root); ``log_dir``'s mode is tightened to 0700.
        Raises :class:`providers.base.Unsupported` (``code="LogDirUnsafe"``) for a ``log_dir`` the account does
        not own (it could not write its jobs' output, or others could read it). A directory this host cannot
        make (it is only on the compute nodes) is left to the operator. ``create=False``: only check (nothing is
        made or changed; a ``log_dir`` others can read is refused)."""
        import os

        _, uid, gid = self.submit_account()
        for name in ("log_dir", "checkpoint_root"):
            d = Path(getattr(self.settings, name))
            if not d.exists():
                if not create:
                    continue
                try:
                    d.mkdir(mode=0o700, parents=True)
                    if os.geteuid() == 0 and uid is not None and uid != 0:
                        os.chown(d, uid, gid if gid is not None else -1)
                except OSError:
                    continue
            if name != "log_dir" or uid is None:
                continue
            st = d.stat()
            if st.st_uid != uid:
                raise Unsupported(f"log_dir={str(d)!r}: owned by uid {st.st_uid}, not by the submit account "
                                  f"{self.submit_account()[0]!r} (uid {uid}): make it mode 0700 owned by that account",
                                  self._option(), "LogDirUnsafe")
            if st.st_mode & 0o077 and not create:
                raise Unsupported(f"log_dir={str(d)!r}: mode {st.st_mode & 0o7777:o} lets other users read job logs "
                                  "(the broker makes it 0700 when it plans the pool)", self._option(), "LogDirUnsafe")
            if st.st_mode & 0o077:
                try:
                    d.chmod(0o700)
                except OSError as e:
                    raise Unsupported(f"log_dir={str(d)!r}: mode {st.st_mode & 0o7777:o} lets other users read job "
                                      f"logs and cannot be made 0700 ({e})", self._option(), "LogDirUnsafe") from None

    def log_files(self, stdout: str | None) -> dict[int, Path]:
        """Node rank -> the output file of that rank, for the job whose batch output file is ``stdout``
        (:data:`BATCH_LOG`): a gang's rank files (:data:`RANK_LOG`) that exist, else ``{0: stdout}``. Plus
        ``-1`` -> the batch file for a gang (its ``srun`` messages). ``{}`` for no path."""
        if not stdout:
            return {}
        p = Path(stdout)
        m = _LOG_FILE_RE.fullmatch(p.name)
        ranks: dict[int, Path] = {}
        if m:
            try:
                for f in p.parent.glob(f"fedbroker-{m.group(1)}-rank*.out"):
                    fm = _LOG_FILE_RE.fullmatch(f.name)
                    if fm and fm.group(2) is not None:
                        ranks[int(fm.group(2))] = f
            except OSError:
                ranks = {}
        if not ranks:
            return {0: p}
        return {**dict(sorted(ranks.items())), -1: p}

    def purge_logs(self, before: datetime) -> int:
        """Remove this pool's job output files in ``log_dir`` (:data:`BATCH_LOG`, :data:`RANK_LOG`) last written
        before ``before`` (aware); returns how many. Other files are never touched; a ``log_dir`` this host does
        not see removes nothing."""
        cutoff = before.timestamp()
        n = 0
        try:
            files = list(Path(self.settings.log_dir).iterdir())
        except OSError:
            return 0
        for f in files:
            try:
                if _LOG_FILE_RE.fullmatch(f.name) and f.is_file() and f.stat().st_mtime < cutoff:
                    f.unlink()
                    n += 1
            except OSError:
                continue
        return n

    # ---------------------------------------------------------------- capacity
    def capacity(self) -> list[NodeCapacity]:
        """Every node of the partition with its GPUs per type, total and in use (``sinfo -N``; REST: ``GET nodes``,
        a node's state flags appended as ``+FLAG``, which makes it unusable)."""
        if self.settings.rest_url:
            nodes = {}
            for n in self._rest("GET", "nodes").get("nodes") or []:
                if self.settings.partition in (n.get("partitions") or []):
                    state = str(n.get("state", "")) + "".join(f"+{f}" for f in n.get("state_flags") or [])
                    nodes[n["name"]] = NodeCapacity(n["name"], state, parse_gres(n.get("gres") or ""),
                                                    parse_gres(n.get("gres_used") or ""))
            if not nodes:
                raise Unsupported(f"partition {self.settings.partition!r} has no nodes (or does not exist)",
                                  self._option(), "InvalidPartition")
            return [nodes[k] for k in sorted(nodes)]
        r = self._run("sinfo", "-h", "-N", "-p", self.settings.partition,
                      "-O", "NodeList:|,StateLong:|,Gres:|,GresUsed:|")
        nodes = {}
        for line in r.stdout.splitlines():
            f = line.split("|")
            if len(f) < 4 or not f[0].strip():
                continue
            name = f[0].strip()
            nodes[name] = NodeCapacity(name, f[1].strip(), parse_gres(f[2]), parse_gres(f[3]))
        if not nodes:
            raise Unsupported(f"partition {self.settings.partition!r} has no nodes (or does not exist)",
                              self._option(), "InvalidPartition")
        return [nodes[k] for k in sorted(nodes)]

    def free_gpus(self) -> dict[str, int]:
        """GPU type -> GPUs free now over the partition's usable nodes (:func:`providers.base.free_gpus_of`)."""
        return free_gpus_of(self.capacity())

    def backlog(self) -> dict[str, int]:
        """GPU type -> GPUs asked for by the partition's pending jobs that are not this broker's (the cluster's own
        queue ahead of a job the broker would send): nodes x GPUs per node of each job (``squeue -t PENDING``;
        REST: ``GET jobs``). A job whose GPUs are not per node (``--gpus``, ``--gres`` per task) is left out."""
        return {t: g for t, (g, _) in self.pending_work().items()}

    def pending_work(self) -> dict[str, tuple[int, float]]:
        """GPU type -> ``(GPUs, GPU-seconds)`` of :meth:`backlog`'s jobs: the GPU-seconds at each job's time limit
        (the most it can hold them; a job without a limit adds its GPUs and no GPU-seconds). One request."""
        rows: list[tuple[str, str, str, float | None]] = []  # (nodes, tres per node, comment, time limit s)
        if self.settings.rest_url:
            for j in self._rest("GET", "jobs").get("jobs") or []:
                if j.get("job_state") == "PENDING" and self.settings.partition in str(j.get("partition", "")).split(","):
                    lim = j.get("time_limit")
                    rows.append((str(j.get("node_count") or 1), str(j.get("tres_per_node") or ""),
                                 str(j.get("comment") or ""), float(lim) * 60 if isinstance(lim, int) else None))
        else:
            r = self._run("squeue", "-h", "-a", "-p", self.settings.partition, "-t", "PENDING", "-o", "%D|%b|%l|%k")
            for line in r.stdout.splitlines():
                f = line.split("|", 3)
                if len(f) == 4:
                    rows.append((f[0], f[1], f[3], _duration_s(f[2])))
        out: dict[str, tuple[int, float]] = {}
        for nodes, tres, comment, limit_s in rows:
            if parse_tags(comment).get(MANAGED_TAG) == self.settings.broker_id:
                continue
            n = int(nodes) if nodes.strip().isdigit() else 1
            for typ, cnt in parse_gres(tres.replace("gres:", "").replace("gres/", "")).items():
                g, gs = out.get(typ, (0, 0.0))
                out[typ] = (g + n * cnt, gs + n * cnt * (limit_s or 0.0))
        return out

    def consumed_energy_j(self, slurm_job_id: str) -> float | None:
        """The energy the cluster accounted for the job, J (``sacct`` ``ConsumedEnergyRaw``: the nodes' energy as its
        ``AcctGatherEnergyType`` plugin measures it); ``None`` when the cluster keeps no accounting, the plugin
        records nothing (0) or the client is missing. Never raises for those."""
        if not str(slurm_job_id).isdigit():
            raise ValueError(f"slurm_job_id={slurm_job_id!r}: must be a Slurm job id (digits)")
        try:
            r = self._run("sacct", "-X", "-n", "-P", "-j", str(slurm_job_id), "--format=JobID,ConsumedEnergyRaw",
                          check=False)
        except SchedulerUnavailable:
            return None
        for line in r.stdout.splitlines():
            f = line.split("|")
            if r.returncode == 0 and len(f) >= 2 and f[0] == str(slurm_job_id) and f[1].strip().isdigit():
                return float(f[1]) if int(f[1]) > 0 else None
        return None

    def release_profile(self) -> list[tuple[datetime, str, int]]:
        """``(end, gpu_type, gpus)`` for every running job of the partition, soonest first: when its GPUs come back
        at the latest (``end`` = start + time limit, aware UTC; Slurm's ``EndTime`` / ``end_time``). Every job counts,
        the broker's and the cluster's own. A job without a time limit or per-node GPUs is left out."""
        rows: list[tuple[float | None, str, str]] = []  # (end epoch s, nodes, tres per node)
        if self.settings.rest_url:
            for j in self._rest("GET", "jobs").get("jobs") or []:
                if j.get("job_state") == "RUNNING" and self.settings.partition in str(j.get("partition", "")).split(","):
                    end = j.get("end_time")
                    rows.append((float(end) if isinstance(end, int) and end > 0 else None, str(j.get("node_count") or 1),
                                 str(j.get("tres_per_node") or "")))
        else:
            r = self._run("scontrol", "-a", "-o", "show", "job")
            for line in r.stdout.splitlines():
                kv = parse_scontrol(line) if line.startswith("JobId=") else {}
                if kv.get("JobState") == "RUNNING" and self.settings.partition in kv.get("Partition", "").split(","):
                    rows.append((_epoch_local(kv.get("EndTime")), kv.get("NumNodes", "1"), kv.get("TresPerNode", "")))
        out = []
        for end, nodes, tres in rows:
            if end is None:
                continue
            n = int(nodes) if nodes.strip().isdigit() else 1
            for typ, cnt in parse_gres(tres.replace("gres:", "").replace("gres/", "")).items():
                out.append((datetime.fromtimestamp(end, timezone.utc), typ, n * cnt))
        return sorted(out)

    # ---------------------------------------------------------------- submit
    def batch_script(self, req: SlurmJobRequest) -> str:
        """The batch script of ``req`` (bash; module docstring). It starts from Slurm's own ``SLURM_*`` variables
        only (``--export=NONE``; any other variable, e.g. from the account's login environment, is unset: only
        ``SLURM_*`` and Slurm's GPU/host variables, :data:`_SLURM_ENV`, stay) and sets the job environment of every
        runtime: ``PATH``
        (:data:`providers.launch.SAFE_PATH`, ``bin_dir`` first), ``HOME`` (a fresh working directory per node
        rank, mode 0700, removed when the rank ends), ``LANG=C.UTF-8``, ``TZ=UTC``, ``req.env`` (the launch
        variables) and the rendezvous; ``CUDA_VISIBLE_DEVICES`` is Slurm's (the GRES it gave). It makes its
        output file 0600 and ``CHECKPOINT_DIR`` (mode 0700, as the job's user; exit 1 with the reason when it
        cannot), then runs the command with its stdout+stderr capped at ``log_max_bytes``: the first half, a line
        ``[fedbroker: N bytes of output dropped here ...]``, the last half (``head -c``, ``dd``, ``tail -c``:
        coreutils on the nodes). The cap's processes ignore SIGTERM, so a cancelled job's tail is still written."""
        s = self.settings
        keep_head = s.log_max_bytes // 2
        keep_tail = s.log_max_bytes - keep_head
        path = f"{s.bin_dir}:{SAFE_PATH}" if s.bin_dir else SAFE_PATH
        batch_log = str(Path(s.log_dir) / BATCH_LOG.replace("%j", "$SLURM_JOB_ID"))
        lines = ["#!/bin/bash", "set -u", "umask 077",
                 _TERM_BEFORE,
                 f'chmod 0600 -- "{batch_log}" 2>/dev/null',
                 # what slurmd may add from the account's login environment (--get-user-env) goes too
                 f'for fb_v in $(compgen -e); do case "$fb_v" in {_SLURM_ENV}) ;; *) unset "$fb_v" ;; esac; done',
                 f"unset fb_v; export PATH={shlex.quote(path)} LANG=C.UTF-8 TZ=UTC"]
        for k, v in sorted(req.env.items()):
            lines.append(f"export {k}={shlex.quote(str(v))}")
        lines += [
            f"export FEDBROKER_JOB_ID={shlex.quote(req.job_id)} FEDBROKER_ATTEMPT={req.attempt}",
            'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            f"export MASTER_PORT={RENDEZVOUS_PORT} NNODES={req.nodes}",
            'export PET_MASTER_ADDR="$MASTER_ADDR"',
            "fb_cap() {  # stdin -> stdout: the first $1 bytes, what was dropped, the last $2 bytes ($3: a scratch file)",
            '  head -c "$1"',
            '  dd bs=65536 2>"$3.n" | tail -c "$2" >"$3"',
            '  local n; n=$(sed -n "s/^\\([0-9][0-9]*\\) bytes.*/\\1/p" "$3.n")',
            '  if [ "${n:-0}" -gt "$2" ]; then',
            '    printf "\\n[fedbroker: %s bytes of output dropped here (log_max_bytes %s: the first %s and the last '
            '%s bytes are kept)]\\n" "$((n - $2))" "$(($1 + $2))" "$1" "$2"',
            "  fi",
            '  cat -- "$3"',
            "}",
            "fb_rank() {  # one node rank: its own HOME, CHECKPOINT_DIR, the command with its output capped",
            '  if [ -n "${CHECKPOINT_DIR:-}" ] && ! mkdir -p -- "$CHECKPOINT_DIR"; then',
            '    echo "fedbroker: cannot create CHECKPOINT_DIR=$CHECKPOINT_DIR as $(id -un) (checkpoint_root must exist'
            ' on every node and be writable by the submit account)" >&2',
            "    return 1",
            "  fi",
            '  local work rc; work=$(mktemp -d "${TMPDIR:-/tmp}/fedbroker-XXXXXXXX") || return 1',
            '  export HOME="$work"; cd "$work" || return 1',
            "  trap : TERM  # from here the command gets scancel's SIGTERM itself; the shell waits for the capped output",
            f"  bash -c {shlex.quote(req.command)} 2>&1 | {{ trap '' TERM; fb_cap {keep_head} {keep_tail} "
            '"$work/.fedbroker-tail"; }',
            "  rc=${PIPESTATUS[0]}",
            '  cd / && rm -rf -- "$work"',
            '  return "$rc"',
            "}",
        ]
        if req.nodes == 1:
            lines.append("export NODE_RANK=0 FEDBROKER_RANK=0 PET_NODE_RANK=0")
            lines.append("fb_rank; rc=$?")
            # a command killed by a signal ends the job the same way (Slurm reports ExitCode=0:SIGNAL)
            lines.append('if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then trap - TERM; kill -s "$((rc - 128))" $$; fi')
            lines.append('exit "$rc"')
        else:
            rank_log = str(Path(s.log_dir) / RANK_LOG)
            inner = (f'{_TERM_BEFORE}; export NODE_RANK="$SLURM_NODEID" FEDBROKER_RANK="$SLURM_NODEID" '
                     'PET_NODE_RANK="$SLURM_NODEID"; '
                     f'chmod 0600 -- "{s.log_dir}/fedbroker-$SLURM_JOB_ID-rank$SLURM_PROCID.out" 2>/dev/null; fb_rank')
            lines.append("export -f fb_cap fb_rank")
            lines.append(f"srun --export=ALL --kill-on-bad-exit=1 --nodes={req.nodes} --ntasks-per-node=1 "
                         f"--output={shlex.quote(rank_log)} bash -c {shlex.quote(inner)}")
            lines.append('exit "$?"')
        return "\n".join(lines) + "\n"

    @staticmethod
    def gres_request(req: SlurmJobRequest) -> str:
        """``--gpus-per-node``'s value: ``TYPE:COUNT``, or ``COUNT`` for the untyped GRES (:data:`UNTYPED_GRES`)."""
        if req.gpu_type == UNTYPED_GRES:
            return str(req.gpus_per_node)
        return f"{req.gpu_type}:{req.gpus_per_node}"

    def sbatch_argv(self, req: SlurmJobRequest) -> list[str]:
        """The ``sbatch`` arguments of ``req`` (module docstring)."""
        s = self.settings
        tags = self._tags(req)
        argv = ["sbatch", "--parsable", "--export=NONE", f"--partition={s.partition}",
                f"--job-name=fb-{req.job_id}-a{req.attempt}",
                f"--nodes={req.nodes}", "--ntasks-per-node=1", f"--gpus-per-node={self.gres_request(req)}",
                f"--time={time_limit_min(req.estimate_s, s.slack_frac, s.slack_s, req.time_limit_s)}",
                "--comment=" + ",".join(f"{k}={v}" for k, v in tags.items()),
                "--no-requeue", f"--output={Path(s.log_dir) / BATCH_LOG}", f"--chdir={s.log_dir}"]
        if req.deadline is not None:
            argv.append(f"--deadline={_local(req.deadline)}")
        if req.begin is not None:
            argv.append(f"--begin={_local(req.begin)}")
        qos = s.qos_by_class.get(req.priority_class or "")
        if qos:
            argv.append(f"--qos={qos}")
        if s.wckey:
            argv.append(f"--wckey={s.wckey}")
        return argv

    def submit(self, req: SlurmJobRequest, require_free: bool = False) -> SlurmJobInfo:
        """Submit ``req``; returns the job as the cluster sees it right after. ``Unsupported`` when no node of the
        partition has ``gpus_per_node`` GPUs of ``gpu_type`` (or the partition has too few such nodes);
        ``NoCapacity`` with ``require_free`` when fewer than ``nodes`` nodes have them free now."""
        option = self._option(req.gpu_type)
        nodes = self.capacity()
        fit = [n for n in nodes if n.gpus_total.get(req.gpu_type, 0) >= req.gpus_per_node]
        if not fit:
            have = sorted({t for n in nodes for t in n.gpus_total})
            raise Unsupported(f"gpu_type={req.gpu_type!r} x {req.gpus_per_node}: no node of partition "
                              f"{self.settings.partition!r} has that (GPU types there: {have})", option, "NoSuchGres")
        if len(fit) < req.nodes:
            raise Unsupported(f"nodes={req.nodes}: partition {self.settings.partition!r} has {len(fit)} nodes with "
                              f"{req.gpus_per_node} x {req.gpu_type}", option, "TooFewNodes")
        if require_free:
            free = sum(1 for n in fit if n.gpus_free(req.gpu_type) >= req.gpus_per_node)
            if free < req.nodes:
                raise NoCapacity(f"{free} of the {req.nodes} nodes needed have {req.gpus_per_node} x {req.gpu_type} "
                                 "free now", option, "NoCapacity")
        self.prepare_directories()  # the submit account first: refused before anything is sent
        if self.settings.rest_url:
            data = self._rest("POST", "job/submit", {"script": self.batch_script(req), "job": self.rest_job(req)},
                              option=option)
            sid = str(data.get("job_id", ""))
        else:
            r = self._run(*self.sbatch_argv(req), input=self.batch_script(req), option=option, as_account=True)
            sid = r.stdout.strip().split(";")[0]
        if not sid.isdigit():
            raise ProviderError(f"submit: unexpected answer (job id {sid!r})", option)
        return self.describe(sid)

    def rest_job(self, req: SlurmJobRequest) -> dict:
        """The ``job`` object of ``POST job/submit`` (OpenAPI v0.0.38): the same request as :meth:`sbatch_argv`.
        The job's environment is :meth:`client_environment` (``PATH``, ``LANG``, ``SLURM_CONF``); the rest comes
        from the batch script."""
        s = self.settings
        job: dict = {"name": f"fb-{req.job_id}-a{req.attempt}", "partition": s.partition, "nodes": req.nodes,
                     "tasks_per_node": 1, "gpus_per_node": self.gres_request(req),
                     "time_limit": time_limit_min(req.estimate_s, s.slack_frac, s.slack_s, req.time_limit_s),
                     "comment": ",".join(f"{k}={v}" for k, v in self._tags(req).items()), "requeue": False,
                     "current_working_directory": s.log_dir, "standard_output": str(Path(s.log_dir) / BATCH_LOG),
                     "environment": self.client_environment()}
        if req.deadline is not None:
            job["deadline"] = _local(req.deadline)
        if req.begin is not None:
            job["begin_time"] = _local(req.begin)
        qos = s.qos_by_class.get(req.priority_class or "")
        if qos:
            job["qos"] = qos
        if s.wckey:
            job["wckey"] = s.wckey
        return job

    def _tags(self, req: SlurmJobRequest) -> dict[str, str]:
        return {MANAGED_TAG: self.settings.broker_id, "fedbroker-job": req.job_id,
                "fedbroker-attempt": str(req.attempt), "fedbroker-team": req.team}

    # ---------------------------------------------------------------- describe
    def describe(self, slurm_job_id: str) -> SlurmJobInfo:
        """The job now (``scontrol show job``; ``sacct`` once scontrol has forgotten it).
        ``ProviderError(code="NotFound")`` when neither knows it."""
        if not str(slurm_job_id).isdigit():
            raise ValueError(f"slurm_job_id={slurm_job_id!r}: must be a Slurm job id (digits)")
        if self.settings.rest_url:
            jobs = self._rest("GET", f"job/{slurm_job_id}").get("jobs") or []
            if not jobs:
                raise ProviderError(f"slurm job {slurm_job_id}: the cluster does not know it", self._option(), "NotFound")
            return self._from_scontrol(_rest_kv(jobs[0]))
        r = self._run("scontrol", "-o", "show", "job", str(slurm_job_id), check=False)
        if r.returncode == 0 and r.stdout.strip():
            return self._from_scontrol(parse_scontrol(r.stdout.strip().splitlines()[0]))
        err = (r.stderr or "").strip()
        if "invalid job id" not in err.lower():
            raise self._error("scontrol", err, self._option())
        return self._from_sacct(str(slurm_job_id))

    def _from_scontrol(self, kv: Mapping[str, str]) -> SlurmJobInfo:
        slurm_state = kv.get("JobState", "")
        code, sig = _exit(kv.get("ExitCode"))
        tags = parse_tags(kv.get("Comment", ""))
        state = lifecycle_state(slurm_state)
        if state in ("starting", "running"):
            code = sig = None
        outcome = self._outcome(state, slurm_state, code, sig, tags, kv.get("Reason", ""), kv.get("AdminComment", ""),
                                kv.get("NodeList", ""))
        restarts = int(kv.get("Restarts", "0") or 0) if (kv.get("Restarts") or "0").isdigit() else 0
        if restarts and state in ("starting", "running") and not tags.get(CANCEL_MARK):
            # Slurm requeued the job itself (node failure; --no-requeue cannot be set through slurmrestd v0.0.38):
            # the attempt is over, the broker requeues it and cancels this copy (cancel/sweep act on slurm_active)
            outcome = ("interrupted", outcome[1], None, None,
                       f"Slurm requeued the job itself (restart {restarts}, Slurm reason {kv.get('Reason') or 'none'}): "
                       "the broker requeues the attempt and cancels this copy")
        return SlurmJobInfo(kv["JobId"], *outcome,
                            nodes=kv.get("NodeList", ""), elapsed_s=_duration_s(kv.get("RunTime")), tags=tags,
                            stdout=kv.get("StdOut"), time_limit_s=_duration_s(kv.get("TimeLimit")),
                            active=_slurm_active(outcome[1]))

    def _from_sacct(self, sid: str) -> SlurmJobInfo:
        r = self._run("sacct", "-X", "-n", "-P", "-j", sid,
                      "--format=JobID,State,ExitCode,ElapsedRaw,Comment,NodeList,Reason,TimelimitRaw", check=False)
        lines = [ln for ln in r.stdout.splitlines() if ln.split("|")[0] == sid]
        if r.returncode != 0 or not lines:
            raise ProviderError(f"slurm job {sid}: the cluster does not know it "
                                f"({(r.stderr or 'sacct: no record').strip()})", self._option(), "NotFound")
        f = (lines[-1].split("|") + [""] * 8)[:8]
        state = lifecycle_state(f[1])
        code, sig = _exit(f[2])
        tags = parse_tags(f[4])
        lim = float(f[7]) * 60 if f[7].isdigit() else None
        outcome = self._outcome(state, f[1], code, sig, tags, f[6], "", f[5])
        return SlurmJobInfo(sid, *outcome, nodes=f[5], elapsed_s=float(f[3]) if f[3].isdigit() else None, tags=tags,
                            time_limit_s=lim, active=_slurm_active(outcome[1]))

    @staticmethod
    def _outcome(state: str, slurm_state: str, code: int | None, sig: int | None, tags: Mapping[str, str],
                 reason: str, admin_comment: str, nodes: str) -> tuple[str, str, int | None, int | None, str]:
        """``(state, slurm_state, exit_code, signal, reason)``: the lifecycle reason sentence."""
        base = slurm_state.split()[0] if slurm_state else ""
        note = f"; admin comment: {admin_comment}" if admin_comment and admin_comment != "(null)" else ""
        if tags.get(CANCEL_MARK) and state in ("cancelled", "failed", "succeeded"):
            state, why = "cancelled", "cancelled by the broker"
        elif state == "cancelled":
            why = (f"cancelled in the cluster, not by the broker (scancel by an administrator or the job's owner; "
                   f"signal {sig}){note}")
        elif state == "interrupted":
            why = f"{base} on {nodes or 'its nodes'} (Slurm reason {reason or 'none'}): the broker requeues the attempt"
        elif state == "failed":
            why = {"TIMEOUT": "reached its time limit", "DEADLINE": "reached its --deadline",
                   "OUT_OF_MEMORY": "ran out of memory", "BOOT_FAIL": "a node failed to boot"}.get(
                       base, f"exited with code {code}" + (f" (signal {sig})" if sig else "")) + note
        elif state == "succeeded":
            why = "exited with code 0"
        elif state == "starting":
            why = f"pending in the cluster's queue (Slurm reason {reason or 'none'})"
        else:
            why = f"{base.lower()} on {nodes}"
        return state, base, code, sig, why

    # ---------------------------------------------------------------- cancel
    def cancel(self, slurm_job_id: str, grace_s: float | None = None) -> SlurmJobInfo:
        """Stop the job: mark it as cancelled by the broker (its comment), send SIGTERM to every process of it
        (``scancel --full --signal=TERM``), wait up to ``grace_s`` (default ``settings.term_grace_s``) for it to end,
        then ``scancel`` (Slurm kills after its ``KillWait``). A finished job is returned as it is; an unknown one raises
        ``ProviderError(code="NotFound")``."""
        grace = self.settings.term_grace_s if grace_s is None else grace_s
        info = self.describe(slurm_job_id)
        if not info.slurm_active:
            return info
        comment = ",".join(f"{k}={v}" for k, v in {**info.tags, CANCEL_MARK: "1"}.items())
        rest = bool(self.settings.rest_url)
        sid = str(slurm_job_id)
        if rest:
            self._rest("POST", f"job/{sid}", {"comment": comment})
        else:
            self._run("scontrol", "update", f"JobId={sid}", f"Comment={comment}", check=False)
        if info.slurm_state not in _STARTING:
            if rest:  # slurm_kill_job(SIGTERM): every step, the batch shell included
                self._rest("DELETE", f"job/{sid}?signal=TERM")
            else:
                self._run("scancel", "--full", "--signal=TERM", sid, check=False)
            info = self._wait_terminal(sid, grace)
        if info.slurm_active:
            if rest:  # DELETE without a signal: SIGKILL, the job ends
                self._rest("DELETE", f"job/{sid}")
            else:
                self._run("scancel", sid, check=False)
        return self._wait_terminal(sid, 30.0)

    def _wait_terminal(self, slurm_job_id: str, timeout_s: float) -> SlurmJobInfo:
        end = time.monotonic() + timeout_s
        while True:
            info = self.describe(slurm_job_id)
            if not info.slurm_active or time.monotonic() >= end:
                return info
            time.sleep(0.2)

    # ---------------------------------------------------------------- sweep
    def poll(self) -> dict[str, SlurmJobInfo]:
        """Slurm job id -> the job now, for every job of this broker (``fedbroker-broker`` tag) the controller still
        holds (queued, running, and finished less than ``MinJobAge`` ago), in one request: ``scontrol -o show job``
        (CLI) or ``GET jobs`` (REST). What a broker cycle calls instead of one :meth:`describe` per tracked job."""
        if self.settings.rest_url:
            rows = [_rest_kv(j) for j in self._rest("GET", "jobs").get("jobs") or []]
        else:
            r = self._run("scontrol", "-a", "-o", "show", "job")
            rows = [parse_scontrol(line) for line in r.stdout.splitlines() if line.startswith("JobId=")]
        out = {}
        for kv in rows:
            if parse_tags(kv.get("Comment", "")).get(MANAGED_TAG) == self.settings.broker_id:
                info = self._from_scontrol(kv)
                out[info.slurm_job_id] = info
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    def list_managed(self) -> list[SlurmJobInfo]:
        """Every job of this broker the cluster still runs or queues (:meth:`poll`), a copy Slurm requeued itself
        included."""
        return [i for i in self.poll().values() if i.slurm_active]

    def sweep(self, live: Iterable[tuple[str, int]], grace_s: float | None = None) -> list[SlurmJobInfo]:
        """Cancel this broker's jobs whose ``(job, attempt)`` is not in ``live`` (a broker that crashed after
        ``sbatch``); returns them as they were found."""
        live_set = set(live)
        gone = []
        for info in self.list_managed():
            att = info.tags.get("fedbroker-attempt", "")
            key = (info.tags.get("fedbroker-job", ""), int(att) if att.isdigit() else None)
            if key not in live_set:
                self.cancel(info.slurm_job_id, grace_s)
                gone.append(info)
        return gone


def _hms(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _rest_kv(j: Mapping) -> dict[str, str]:
    """A job of the OpenAPI v0.0.38 ``jobs`` answer in ``scontrol show job`` terms. ``exit_code`` there is the
    raw wait status: code = status >> 8, signal = status & 0x7f."""
    st = int(j.get("exit_code") or 0)
    start, end = int(j.get("start_time") or 0), int(j.get("end_time") or 0)
    state = str(j.get("job_state", ""))
    run = 0.0
    if start and state not in _STARTING:
        run = (end if end and lifecycle_state(state) in TERMINAL else time.time()) - start
    sid = str(j.get("job_id"))
    out = str(j.get("standard_output") or "").replace("%j", sid)
    lim = j.get("time_limit")
    return {"JobId": sid, "JobState": state, "ExitCode": f"{(st >> 8) & 0xff}:{st & 0x7f}",
            "Comment": str(j.get("comment") or ""), "AdminComment": str(j.get("admin_comment") or ""),
            "Reason": str(j.get("state_reason") or ""), "NodeList": str(j.get("nodes") or ""),
            "RunTime": _hms(run), "TimeLimit": _hms(int(lim) * 60) if isinstance(lim, int) else "",
            "StdOut": out, "Restarts": str(int(j.get("restart_cnt") or 0))}


def _epoch_local(text: str | None) -> float | None:
    """Slurm's local ``YYYY-MM-DDTHH:MM:SS`` -> epoch seconds; ``None`` for ``Unknown``/``N/A``/``None``."""
    try:
        return time.mktime(time.strptime(text or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _exit(text: str | None) -> tuple[int | None, int | None]:
    """Slurm ``ExitCode=code:signal`` -> ``(code, signal)``."""
    m = re.fullmatch(r"(\d+):(\d+)", (text or "").strip())
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def _local(t: datetime) -> str:
    """An aware datetime as Slurm's ``YYYY-MM-DDTHH:MM:SS`` in this machine's local time (Slurm reads times
    without a zone as the controller's local time: run the adapter in the controller's zone, or UTC on both)."""
    return t.astimezone().replace(tzinfo=None).strftime("%Y-%m-%dT%H:%M:%S")
