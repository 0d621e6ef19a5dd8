"""The node agent's nftables table: its jobs' uids cannot open a TCP connection to the broker's services.

A job on an agent host that reached the broker's password-less Redis stopped intake for every team
(``SET fedbroker:planner-lock x EX 300``) and locked another team out of submitting
(``HSET fedbroker:rate:victim ...``). A root agent therefore installs one table of its own,
``inet fedbroker_agent_<node>_<hash of what it guards>``, with one ``output`` chain that answers a TCP reset (``connect()``:
"Connection refused") to a socket owned by a job uid (``meta skuid``: ``jobs.uid_range`` and every configured
job user) that connects

* to a port of the broker's services (``blocked_endpoints`` of ``GET /v1/node/config``: ``redis_url``,
  ``database_url``, ``jobs.blocked_endpoints``, see :mod:`broker.service.service_endpoints`) on any address of
  this host (``fib daddr type local``: 127.0.0.1, ::1 and every interface address), and
* to that port on the addresses the endpoint's host name resolves to here (IPv4 and IPv6), when it is remote
  (resolved when the table is installed, at the agent's start: a name that moves later needs a restart).

Root and every other uid are not matched (the agent and the broker keep their connections); other ports, e.g.
the torchrun rendezvous of a gang, are not either. The table is replaced whole in one ``nft -f`` transaction
(idempotent: an agent restarted, or one killed with ``kill -9``, installs it again over the old one) and deleted
by :meth:`NetworkGuard.remove` when the agent stops with no job running on the node (while a job runs, it keeps
its rules: a restarted agent replaces them). UNIX sockets are not network traffic: the shim hides them
(:class:`workers.isolation.PrivateView`).

Errors: :class:`NetworkGuardError` (``nft`` missing, or the kernel refused the table: its message and the fix).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import shutil
import socket
import subprocess

__all__ = ["NetworkGuard", "NetworkGuardError", "table_name"]

log = logging.getLogger("fedbroker.agent")


class NetworkGuardError(RuntimeError):
    """The agent's nftables table could not be installed (or removed); the message says why and what to do."""


def table_name(node: str, guards: str = "") -> str:
    """``fedbroker_agent_<node>``: the node name with every character nft names do not take as ``_``, and, when
    that changed it or it is long, 8 hex digits of its SHA-256 (two node names never share a table). With
    ``guards`` (what the table guards: its uids and ports, :attr:`NetworkGuard.guards`), 8 more hex digits of
    that: two brokers' agents on one host under the same node name (each broker names it after the host) keep two
    tables, and one stopping deletes its own only (it deleted the other's: a hostile review's jobs then reached
    the other broker's PostgreSQL); the same agent restarted with the same settings finds its own again."""
    safe = re.sub(r"[^A-Za-z0-9_]", "_", node)[:40]
    if safe != node:
        safe += "_" + hashlib.sha256(node.encode()).hexdigest()[:8]
    if guards:
        safe += "_" + hashlib.sha256(guards.encode()).hexdigest()[:8]
    return f"fedbroker_agent_{safe}"


def _addresses(host: str) -> tuple[list[str], list[str]]:
    """The IPv4 and IPv6 addresses ``host`` (a name or an address) resolves to here; none when it does not."""
    try:
        ip = ipaddress.ip_address(host)
        return ([str(ip)], []) if ip.version == 4 else ([], [str(ip)])
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as e:
        log.warning("network guard: cannot resolve %r (%s): only this host's own addresses are guarded for it", host, e)
        return [], []
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0].split("%", 1)[0] for i in infos if i[0] == socket.AF_INET6})
    return v4, v6


class NetworkGuard:
    """One agent's nftables table (see the module docstring).

    Args:
        node: the agent's node name (names the table).
        uids: the job uids, ``[(lo, hi), ...]`` inclusive ranges (a single uid: ``(u, u)``).
        endpoints: ``blocked_endpoints`` of the node config: dicts with ``host`` (or ``None``), ``port`` (or
            ``None``: a UNIX socket only, nothing to do here) and ``setting``.
        nft: the ``nft`` program.
    """

    def __init__(self, node: str, uids, endpoints, nft: str = "nft"):
        self.uids = sorted({(int(lo), int(hi)) for lo, hi in uids})
        self.endpoints = [e for e in endpoints if e.get("port")]
        self.nft = nft
        self.table = table_name(node, self.guards)

    @property
    def guards(self) -> str:
        """What this table guards, as text (its name's second hash): the uid set and each endpoint's host:port."""
        return self._uid_set() + " " + ",".join(sorted(f"{e.get('host')}:{e['port']}" for e in self.endpoints))

    def _uid_set(self) -> str:
        return "{ " + ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.uids) + " }"

    def ruleset(self) -> str:
        """The ``nft -f`` script: the table created (if absent), deleted and made again, in one transaction."""
        t = f"inet {self.table}"
        rules = []
        ports = sorted({int(e["port"]) for e in self.endpoints})
        who = f"meta skuid {self._uid_set()}"
        if ports and self.uids:
            rules.append(f"{who} tcp dport {{ {', '.join(map(str, ports))} }} fib daddr type local "
                         "counter reject with tcp reset")
            by_port: dict[int, tuple[set, set]] = {}
            for e in self.endpoints:
                v4, v6 = _addresses(e["host"]) if e.get("host") else ([], [])
                s4, s6 = by_port.setdefault(int(e["port"]), (set(), set()))
                s4.update(v4)
                s6.update(v6)
            for port, (s4, s6) in sorted(by_port.items()):
                for fam, addrs in (("ip", s4), ("ip6", s6)):
                    addrs = {a for a in addrs if not ipaddress.ip_address(a).is_loopback}  # the local rule has them
                    if addrs:
                        rules.append(f"{who} {fam} daddr {{ {', '.join(sorted(addrs))} }} tcp dport {port} "
                                     "counter reject with tcp reset")
        body = "".join(f"    {r}\n" for r in rules)
        return (f"table {t}\ndelete table {t}\ntable {t} {{\n  chain output {{\n"
                f"    type filter hook output priority filter; policy accept;\n{body}  }}\n}}\n")

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        if shutil.which(self.nft) is None:
            raise NetworkGuardError(
                f"network guard: {self.nft!r} is not installed, so this root agent cannot keep its jobs away from the "
                "broker's Redis and database; install nftables (apt-get install nftables) and start it again")
        return subprocess.run([self.nft, *args], input=stdin, capture_output=True, text=True, timeout=30)

    def install(self) -> None:
        """Install (or replace) the table. Raises :class:`NetworkGuardError` with nft's message."""
        res = self._run(["-f", "-"], self.ruleset())
        if res.returncode != 0:
            raise NetworkGuardError(f"network guard: nft refused table inet {self.table}: "
                                    f"{(res.stderr or res.stdout).strip()[:500]}")
        log.info("network guard: table inet %s installed: uids %s may not connect to %s", self.table,
                 self._uid_set(), ", ".join(f"{e.get('setting')} (port {e['port']})" for e in self.endpoints) or "nothing")

    def remove(self) -> None:
        """Delete the table (nothing to do when it is not there). Raises :class:`NetworkGuardError`."""
        res = self._run(["delete", "table", "inet", self.table])
        if res.returncode != 0 and "No such file" not in res.stderr:
            raise NetworkGuardError(f"network guard: cannot delete table inet {self.table}: {res.stderr.strip()[:500]}")

    def installed(self) -> str | None:
        """``nft list table`` of the table, or ``None`` when it is not there."""
        res = self._run(["list", "table", "inet", self.table])
        return res.stdout if res.returncode == 0 else None
