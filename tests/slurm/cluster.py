"""A real Slurm cluster on 127.0.0.1 for the tests: Debian's ``slurmctld``/``slurmd``/``munge`` 22.05.

:class:`LocalSlurm` writes its own ``slurm.conf``/``gres.conf`` under a temporary directory, starts its own
``munged`` (own key and socket), one ``slurmctld`` and one ``slurmd -N NODE`` per fake GPU node (each node on
127.0.0.1 with its own port, ``NodeHostname`` made up so that Debian's slurmd, built without
``--enable-multiple-slurmd``, accepts several on one host). GPUs are GRES of a named type (``gpu:a100:2``)
whose ``File=`` are character devices 1:3 (``/dev/null`` copies): Slurm 22.05 drops file-less GPUs. Jobs run
for real on this machine (there is no device isolation: ``TaskPlugin=task/none``).

There is no accounting database (``AccountingStorageType=accounting_storage/none``), so no ``sacct``: finished
jobs stay readable through ``scontrol`` for ``MinJobAge`` (600 s here). ``EnforcePartLimits=ALL`` makes
``sbatch`` reject a request over a partition limit instead of queueing it for ever.

Stopping kills only the processes whose pid files this instance wrote (SIGTERM, then SIGKILL after 10 s) and
any ``slurmstepd`` whose environment names this instance's ``slurm.conf``. Needs root (slurmd launches jobs
as their user, munged runs with ``-f``). The same shape at larger scale: ``/work/shared/tools/slurm_local.sh``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NodeGroup", "LocalSlurm", "slurm_available", "free_port_block"]

DAEMONS = ("slurmctld", "slurmd", "slurmrestd", "munged", "mungekey", "sbatch", "squeue", "scontrol", "scancel",
           "sinfo")


def slurm_available() -> str | None:
    """``None`` when a local Slurm can start here, else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "the local Slurm fixture needs root (slurmd launches jobs, munged runs with -f)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"Slurm/munge not installed (missing {', '.join(missing)}); .ci/run installs "
                "slurmctld slurmd slurmrestd slurm-client munge slurm-wlm-jwt-plugin")
    if not list(Path("/usr/lib").glob("*/slurm-wlm/auth_jwt.so")):
        return "Slurm's JWT plugin is not installed (Debian package slurm-wlm-jwt-plugin; .ci/run installs it)"
    return None


def free_port_block(n: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port ``p`` in ``[start, stop)`` such that ``p .. p+n-1`` are all free on 127.0.0.1 now."""
    p = start
    while p + n <= stop:
        for i in range(n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + i))
                except OSError:
                    p += i + 1
                    break
        else:
            return p
    raise RuntimeError(f"no {n} consecutive free ports in [{start}, {stop})")


@dataclass(frozen=True)
class NodeGroup:
    """``count`` nodes named ``{prefix}NNN`` with ``gpus`` GPUs each of GRES type ``gpu_type`` (``""``: untyped,
    ``Gres=gpu:N``)."""

    prefix: str
    count: int
    gpu_type: str
    gpus: int


@dataclass
class LocalSlurm:
    """One local cluster (see the module docstring). ``partition`` holds every node; ``max_time_min`` is its
    ``MaxTime`` (minutes), ``max_nodes`` its ``MaxNodes``."""

    groups: tuple[NodeGroup, ...] = (NodeGroup("a", 3, "a100", 2), NodeGroup("h", 1, "h100", 4))
    partition: str = "gpu"
    max_time_min: int = 60
    max_nodes: int = 2
    rest: bool = True
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fedbroker-slurm-")))
    _started: bool = False
    _restd: subprocess.Popen | None = None

    @property
    def nodes(self) -> list[tuple[str, NodeGroup]]:
        """``(node name, its group)`` for every node, in order."""
        return [(f"{g.prefix}{i:03d}", g) for g in self.groups for i in range(1, g.count + 1)]

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm client needs to talk to this cluster (``SLURM_CONF``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "spool", "run", "log", "dev", "munge", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        n = len(self.nodes)
        self.ctld_port = free_port_block(1, 21000)
        self.slurmd_port = free_port_block(n, self.ctld_port + 1)
        ndev = max(g.gpus for g in self.groups)
        for i in range(ndev):
            dev = r / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # S_IFCHR, like /dev/null
        lines = [
            "ClusterName=fedbroker-test",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge/munge.socket.2", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "MpiDefault=none", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SwitchType=switch/none",
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny", "MailProg=/bin/true",
            "ReturnToService=2", "SlurmdTimeout=300", "InactiveLimit=0", "KillWait=3", "MinJobAge=600",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_min_interval=0,batch_sched_delay=0",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "GresTypes=gpu",
            "PriorityType=priority/basic", "EnforcePartLimits=ALL", "SlurmdParameters=config_overrides",
        ]
        port = self.slurmd_port
        gres = ["AutoDetect=off"]
        for name, g in self.nodes:
            lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} CPUs=8 Boards=1 "
                         f"SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 "
                         f"Gres=gpu:{g.gpu_type + ':' if g.gpu_type else ''}{g.gpus} State=UNKNOWN")
            files = f"{r}/dev/nvidia0" if g.gpus == 1 else f"{r}/dev/nvidia[0-{g.gpus - 1}]"
            typed = f" Type={g.gpu_type}" if g.gpu_type else ""
            gres.append(f"NodeName={name} Name=gpu{typed} File={files}")
            port += 1
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime={self.max_time_min} "
                     f"MaxNodes={self.max_nodes} State=UP")
        if self.rest:
            key = r / "etc" / "jwt_hs256.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            lines += ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={key}"]
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")

    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        """Write the config and start munged, slurmctld and every slurmd; wait until every node is idle."""
        self._write_config()
        self._started = True
        m = self.root / "munge"
        os.chmod(self.root, 0o755)
        os.chmod(m, 0o711)
        subprocess.run(["mungekey", "-c", "-k", str(m / "munge.key")], check=True, capture_output=True)
        os.chmod(m / "munge.key", 0o600)
        subprocess.run(["munged", "-f", f"--socket={m}/munge.socket.2", f"--key-file={m}/munge.key",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True, capture_output=True)
        self._wait(lambda: (m / "munge.socket.2").exists(), 5, "munged socket")
        subprocess.run(["slurmctld", "-c", "-i", "-f", str(self.conf)], env=self.env, check=True, capture_output=True)
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 20, "slurmctld ping")
        for name, _ in self.nodes:
            (self.root / "spool" / name).mkdir(exist_ok=True)
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", name], env=self.env, check=True,
                           capture_output=True)
        n = len(self.nodes)

        def all_idle() -> bool:
            out = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split()
            return len(set(out)) >= n
        self._wait(all_idle, timeout_s, f"{n} idle nodes")
        if self.rest:
            self._start_restd()
        return self

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def jwt_file(self) -> Path:
        return self.root / "etc" / "jwt.token"

    def token(self, lifespan_s: int = 3600, path: Path | None = None, user: str = "root") -> Path:
        """Write a JWT for ``user`` (``scontrol token``, valid ``lifespan_s`` s) to ``path`` (default
        :attr:`jwt_file`)."""
        path = path or self.jwt_file
        path.write_text(self.run("scontrol", "token", f"username={user}", f"lifespan={lifespan_s}").stdout.strip())
        return path

    def _start_restd(self) -> None:
        """``slurmrestd`` on 127.0.0.1 with JWT auth (``SLURM_JWT=daemon``: it passes each request's token on to
        slurmctld), running as ``nobody`` (it refuses root)."""
        import urllib.error
        import urllib.request

        self.rest_port = free_port_block(1, self.slurmd_port + len(self.nodes) + 1)
        self.token()
        log = open(self.root / "log" / "slurmrestd.log", "wb")
        self._restd = subprocess.Popen(
            ["slurmrestd", "-f", str(self.conf), "-a", "rest_auth/jwt", "-s", "openapi/v0.0.38", "-u", "nobody",
             f"127.0.0.1:{self.rest_port}"], env={**self.env, "SLURM_JWT": "daemon"}, stdout=log, stderr=log)
        log.close()
        (self.root / "run" / "slurmrestd.pid").write_text(str(self._restd.pid))

        def answers() -> bool:
            try:
                urllib.request.urlopen(f"{self.rest_url}/openapi", timeout=1)
                return True
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False
        self._wait(answers, 10, "slurmrestd answer")

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if ok():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted((self.root / "log").glob("*.log")))
        self.stop()
        raise RuntimeError(f"local Slurm: no {what} after {timeout_s} s\n{logs}")

    def pids(self) -> list[int]:
        """Pids of this instance's daemons that are alive now."""
        out = []
        for f in [self.root / "munge" / "munged.pid", *(self.root / "run").glob("*.pid")]:  # slurmrestd's too
            try:
                pid = int(f.read_text().strip())
                os.kill(pid, 0)
                out.append(pid)
            except (OSError, ValueError):
                continue
        return out

    @staticmethod
    def alive(pids: list[int]) -> list[int]:
        """Those of ``pids`` still running (zombies count as gone)."""
        out = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                out.append(pid)
        return out

    def stop(self) -> None:
        """Cancel every job, stop the slurmds, slurmctld and munged (by pid file), kill stray job steps."""
        if not self._started:
            return
        self._started = False
        self.run("scancel", "--user=root", check=False)
        time.sleep(0.5)
        run = self.root / "run"
        # every slurmd at once (each takes ~2 s to exit), then the controller, then munged
        if self._restd is not None:
            _term_then_kill([self._restd.pid])
            self._restd.wait(5)
            self._restd = None
        for group in (sorted(run.glob("slurmd-*.pid")), [run / "slurmctld.pid"], [self.root / "munge" / "munged.pid"]):
            pids = []
            for f in group:
                try:
                    pids.append(int(f.read_text().strip()))
                except (OSError, ValueError):
                    continue
            _term_then_kill(pids)
        marker = f"SLURM_CONF={self.conf}".encode()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                if b"slurmstepd" in (p / "cmdline").read_bytes() and marker in (p / "environ").read_bytes():
                    os.kill(int(p.name), signal.SIGKILL)
            except OSError:
                continue

    def cleanup(self) -> None:
        """Stop, then delete the directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _term_then_kill(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each of ``pids``, wait up to ``grace_s`` for all to exit, SIGKILL those left."""
    left = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            left.append(pid)
        except OSError:
            continue
    end = time.monotonic() + grace_s
    while left and time.monotonic() < end:
        left = LocalSlurm.alive(left)
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
