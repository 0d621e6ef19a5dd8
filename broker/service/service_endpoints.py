"""Where the broker's own services listen, as jobs must never reach them: the Redis of ``redis_url`` (Celery's
broker, the planner lock, the rate buckets) and the database of ``database_url``.

:func:`service_endpoints` reads them from the settings. Node agents get them in ``GET /v1/node/config``
(``blocked_endpoints``) and refuse their jobs' uids a connection (:mod:`workers.network_guard`, nftables) and
hide their UNIX sockets (:class:`workers.isolation.PrivateView`); ``serve all`` refuses to run jobs next to one
without a password (:mod:`broker.cli.serve`).

URL forms read (default ports: Redis 6379, PostgreSQL 5432, MySQL 3306)::

    redis://[[user]:password@]host[:port][/db]    rediss://...    unix://[:password@]/path/to.sock[?db=0]
    postgresql[+driver]://[user[:password]@][host][:port]/db[?host=/socket/dir]   (no host: the UNIX socket
        directory /var/run/postgresql, libpq's default)
    sqlite:///path   (a file under the state directory, mode 0700: no endpoint)

A password counts when the URL's userinfo or its ``password`` query parameter holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["ServiceEndpoint", "service_endpoints", "passwordless", "trial_notice", "DEFAULT_PORTS", "PG_SOCKET_DIR"]

#: the services' default TCP ports (Redis, PostgreSQL, MySQL/MariaDB documentation)
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "postgresql": 5432, "postgres": 5432, "mysql": 3306,
                 "mariadb": 3306}
#: libpq's default UNIX socket directory on Debian/Ubuntu/RHEL packages (DEFAULT_PGSOCKET_DIR)
PG_SOCKET_DIR = "/var/run/postgresql"


@dataclass(frozen=True)
class ServiceEndpoint:
    """One endpoint of a broker service: the ``setting`` it comes from (``redis_url``, ``database_url`` or
    ``jobs.blocked_endpoints[i]``), ``kind`` (``redis``, ``postgresql``, ``mysql``, ``tcp``), TCP ``host`` and
    ``port`` or ``None``, a UNIX ``socket`` path (a file or, for PostgreSQL, its directory) or ``None``, and
    whether the URL carries a ``password``."""

    setting: str
    kind: str
    host: str | None = None
    port: int | None = None
    socket: str | None = None
    password: bool = False

    def to_dict(self) -> dict:
        """``{"setting", "kind", "host", "port", "socket", "password"}`` (as served to node agents)."""
        return {"setting": self.setting, "kind": self.kind, "host": self.host, "port": self.port,
                "socket": self.socket, "password": self.password}

    def describe(self) -> str:
        """``redis_url (redis at 127.0.0.1:6379)`` and the like, for messages."""
        where = f"{self.host}:{self.port}" if self.host else self.socket
        return f"{self.setting} ({self.kind} at {where})"


def _from_url(setting: str, url: str) -> ServiceEndpoint | None:
    """The endpoint of one service URL, or ``None`` for SQLite. Raises ``ValueError`` naming ``setting`` for a URL
    whose port is not a number."""
    u = urlsplit(url)
    scheme = u.scheme.lower()
    base = scheme.split("+", 1)[0]
    if base.startswith("sqlite"):
        return None
    query = parse_qs(u.query)
    password = bool(u.password) or bool(query.get("password", [""])[0])
    try:
        port = u.port
    except ValueError:
        raise ValueError(f"{setting}: the port of {u.netloc.rsplit('@', 1)[-1]!r} is not a number") from None
    if base == "unix":
        return ServiceEndpoint(setting, "redis", socket=unquote(u.path), password=password)
    kind = "redis" if base in ("redis", "rediss") else "postgresql" if base in ("postgresql", "postgres") \
        else "mysql" if base in ("mysql", "mariadb") else base
    socket_dir = (query.get("host") or [None])[0]
    if socket_dir and socket_dir.startswith("/"):
        return ServiceEndpoint(setting, kind, socket=socket_dir, password=password)
    if not u.hostname:
        if kind == "postgresql":  # libpq connects to its default socket directory
            return ServiceEndpoint(setting, kind, socket=PG_SOCKET_DIR, password=password)
        return ServiceEndpoint(setting, kind, host="127.0.0.1", port=port or DEFAULT_PORTS.get(base), password=password)
    return ServiceEndpoint(setting, kind, host=u.hostname, port=port or DEFAULT_PORTS.get(base), password=password)


def service_endpoints(settings) -> list[ServiceEndpoint]:
    """The broker's service endpoints for ``settings`` (a :class:`broker.service.settings.BrokerSettings`):
    ``redis_url``, ``database_url`` (none for the embedded SQLite file) and each ``host:port`` of
    ``jobs.blocked_endpoints`` (kind ``tcp``). Raises ``ValueError`` naming the setting for a bad port."""
    out = [_from_url("redis_url", settings.redis_url)]
    if settings.database_url:
        out.append(_from_url("database_url", settings.database_url))
    for i, hp in enumerate(getattr(settings.jobs, "blocked_endpoints", ()) or ()):
        host, _, port = hp.rpartition(":")
        out.append(ServiceEndpoint(f"jobs.blocked_endpoints[{i}]", "tcp", host=host.strip("[]"), port=int(port)))
    return [e for e in out if e is not None]


def passwordless(settings) -> list[ServiceEndpoint]:
    """The endpoints of ``redis_url`` and ``database_url`` whose URL carries no password (any process that reaches
    one can steer the broker: the planner lock, rate buckets, Celery's queues, every job row)."""
    return [e for e in service_endpoints(settings) if e.kind in ("redis", "postgresql", "mysql") and not e.password]


def trial_notice(settings) -> str | None:
    """One line for a broker started in trial mode (``trial``: ``serve all --trial``) that names its password-less
    services, or ``None`` when ``settings.trial`` is off. ``/healthz`` answers it as ``"trial"``."""
    if not getattr(settings, "trial", False):
        return None
    open_ = passwordless(settings)
    what = ", ".join(e.describe() for e in open_) if open_ else "no password-less service"
    return (f"trial mode: {what}; a job that reaches one can stop planning for every team or read the job store. "
            "For a single user on one machine only")
