"""How ``fedbroker serve api`` runs the API: uvicorn with read timeouts, a connection cap and TLS.

What holds a slow client (slow-loris) — uvicorn (0.54) has no header or body read timeout of its
own: its keep-alive timer (``timeout_keep_alive``) only runs *between* requests, so a connection
that sends a few header bytes and then trickles (or nothing) was held forever, and with a
connection cap (``limit_concurrency``) enough of them would turn every new request into a 503.
:class:`GuardedHttpToolsProtocol` (and :class:`GuardedH11Protocol` where httptools is not installed)
add the two timeouts to uvicorn's protocol:

* **header read**: a request's headers must be complete within :data:`HEADER_TIMEOUT_S` of the
  connection opening, or of the first byte after a keep-alive pause (a trickle does not extend it);
* **body read**: its body must be complete within :data:`BODY_TIMEOUT_S` of its headers
  (the body is at most 2 MiB, :data:`broker.service.jsonbody.MAX_BODY_BYTES`);

past either the connection is closed. Together with ``limit_concurrency`` (the cap, answered 503
above it), ``timeout_keep_alive`` (idle keep-alive connections closed after
:data:`KEEP_ALIVE_S`), a request head (line and headers) larger than :data:`MAX_HEADER_BYTES`
answered 400 (counted in the parser callbacks for httptools; h11's ``h11_max_incomplete_event_size``
bounds only a head still incomplete in its buffer) and the body limit of :class:`broker.service.jsonbody.BodyLimit`, no single client can hold
the server. Connections are cheap (asyncio), so partial-header
connections below the cap do not delay other requests (``tests/broker/service/test_httpserver.py``).

What stops one client from filling the cap — ``limit_concurrency`` is one cap for the whole process, so one
host holding ``api_max_connections`` slow connections (each within the read timeouts, reopened as they are cut)
or idle keep-alive ones turned every other team's request into a 503, and a node agent whose heartbeats fail for
``node_lost_after_s`` gets its node declared lost and its jobs requeued (:mod:`broker.service.reconciler`). Both
protocols also count the open connections of each client address (:func:`open_connections_by_peer`, one count per
process, taken in ``connection_made`` and given back in ``connection_lost``): a connection past
``api_max_connections_per_peer`` (:class:`broker.service.settings.BrokerSettings`) is answered
:data:`PEER_REFUSAL` (503, ``Retry-After`` :data:`PEER_RETRY_AFTER_S` s, ``Connection: close``) and closed at
once, before any byte of it is parsed or reaches the app; the refusal is logged at most once a minute per address.
The address is the TCP peer's (``X-Forwarded-For`` is never read: behind a proxy every client is the proxy, so
set the per-peer cap to 0 there and cap per client in the proxy); an IPv4-mapped IPv6 address counts as its
IPv4 one; a connection without a peer address (a Unix socket) is not counted.

A reverse proxy in front (nginx ``client_header_timeout``/``client_body_timeout``, ``limit_conn``) is the usual
production layout and does the same; these limits hold without one.
"""

from __future__ import annotations

import logging
import threading

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from broker.service.log_throttle import KeyedLogThrottle

__all__ = ["GuardedH11Protocol", "GuardedHttpToolsProtocol", "server_config", "open_connections_by_peer",
           "HEADER_TIMEOUT_S", "BODY_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_HEADER_BYTES", "PEER_RETRY_AFTER_S",
           "PEER_REFUSAL"]

log = logging.getLogger("fedbroker.api.server")

#: seconds a request's headers may take to arrive, from the connection (or the first byte of the next request)
HEADER_TIMEOUT_S = 10.0
#: seconds a request's body may take to arrive, from the end of its headers
BODY_TIMEOUT_S = 30.0
#: seconds an idle keep-alive connection is kept between requests
KEEP_ALIVE_S = 5
#: largest request head (request line + headers), bytes; larger is a 400
MAX_HEADER_BYTES = 16 * 1024
#: seconds a client refused for its address's connection cap is told to wait (``Retry-After``): an idle
#: keep-alive connection of that address is closed within :data:`KEEP_ALIVE_S`
PEER_RETRY_AFTER_S = KEEP_ALIVE_S
_PEER_BODY = b"too many connections from your address (api_max_connections_per_peer); retry later\n"
#: the whole answer to a connection over its address's cap, written before the connection is closed
PEER_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"retry-after: %d\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (PEER_RETRY_AFTER_S, len(_PEER_BODY))) + _PEER_BODY

#: open connections per client address, this process (every server in it); guarded by _peers_lock
_open_by_peer: dict[str, int] = {}
_peers_lock = threading.Lock()
#: one refusal line a minute per address, at most 1024 addresses remembered
_refusal_log = KeyedLogThrottle(60.0, max_keys=1024)


def open_connections_by_peer() -> dict[str, int]:
    """A copy of the per-address count of open connections of this process (addresses with none are absent)."""
    with _peers_lock:
        return dict(_open_by_peer)


def _peer_address(host: str) -> str:
    """The address a connection counts against: ``host``, an IPv4-mapped IPv6 ``::ffff:a.b.c.d`` as ``a.b.c.d``."""
    if host.startswith("::ffff:") and "." in host:
        return host[7:]
    return host


class _PeerCap:
    """Mixin of a uvicorn HTTP protocol: the per-address connection cap (``config.fedbroker_max_connections_per_peer``,
    set by :func:`server_config`; 0 or absent = no cap). ``_admit`` runs at the end of ``connection_made``,
    ``_release`` first in ``connection_lost`` (and before a WebSocket upgrade hands the transport over, when no
    ``connection_lost`` would come); only an admitted connection is counted, and ``_release`` gives its count back once."""

    _peer: str | None = None  # the address this connection is counted against, until released
    _refused = False

    def _admit(self) -> bool:
        """Count this connection against its address, or answer :data:`PEER_REFUSAL` and close it (``False``)."""
        cap = getattr(self.config, "fedbroker_max_connections_per_peer", 0) or 0
        if cap <= 0 or not self.client:
            return True
        peer = _peer_address(self.client[0])
        with _peers_lock:
            n = _open_by_peer.get(peer, 0)
            if n < cap:
                _open_by_peer[peer] = n + 1
                self._peer = peer
                return True
        self._refused = True
        if _refusal_log.due(peer):
            log.warning("refusing connections from %s: %d open from that address, api_max_connections_per_peer=%d "
                        "(503, Retry-After %d s; logged once a minute per address)", peer, n, cap, PEER_RETRY_AFTER_S)
        self.transport.write(PEER_REFUSAL)
        self.transport.close()
        return False

    def _release(self) -> None:
        peer, self._peer = self._peer, None
        if peer is None:
            return
        with _peers_lock:
            n = _open_by_peer.get(peer, 0) - 1
            if n > 0:
                _open_by_peer[peer] = n
            else:
                _open_by_peer.pop(peer, None)


class _ReadDeadlines:
    """Mixin of a uvicorn HTTP protocol: one timer per read phase of a request (``"headers"``, ``"body"``);
    a phase keeps the deadline it started with (a trickle does not extend it); past it the connection closes."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    _phase: str | None = None
    _guard = None

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        self._cancel()
        self._phase = phase
        if phase is not None and not self.transport.is_closing():
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._guard = self.loop.call_later(timeout, self._expire, phase, timeout)

    def _cancel(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _expire(self, phase: str, timeout: float) -> None:
        self._guard = None
        if self.transport.is_closing() or self._phase != phase:
            return
        client = "%s:%d" % self.client if self.client else "a client"
        log.info("closing the connection of %s: request %s not received within %.0f s", client, phase, timeout)
        self.transport.close()


class GuardedH11Protocol(_PeerCap, _ReadDeadlines, H11Protocol):
    """uvicorn's h11 protocol with header and body read timeouts (class attributes, seconds; a
    subclass may change them): a request not read in time closes the connection; and the per-address
    connection cap (:class:`_PeerCap`)."""

    def connection_made(self, transport) -> None:  # noqa: D102 - asyncio.Protocol
        super().connection_made(transport)
        if self._admit():
            self._watch()

    def data_received(self, data: bytes) -> None:  # noqa: D102 - asyncio.Protocol
        if self._refused:  # answered and closing: nothing of it is parsed
            return
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc) -> None:  # noqa: D102 - asyncio.Protocol
        self._release()
        self._cancel()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event) -> None:  # noqa: D102 - the transport goes to another protocol
        self._release()
        self._cancel()
        super().handle_websocket_upgrade(event)

    def _watch(self) -> None:
        """The phase h11 is in: reading a request's headers (IDLE) or its body (SEND_BODY), or neither."""
        state = self.conn.their_state
        self._enter("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is optional
    HttpToolsProtocol = None

if HttpToolsProtocol is not None:
    class GuardedHttpToolsProtocol(_PeerCap, _ReadDeadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol (the faster parser) with the same read timeouts and per-address
        connection cap, and a request head over :data:`MAX_HEADER_BYTES` answered 400 (httptools has no limit
        of its own)."""

        _head_bytes = 0

        def connection_made(self, transport) -> None:  # noqa: D102 - asyncio.Protocol
            super().connection_made(transport)
            if self._admit():
                self._enter("headers")

        def data_received(self, data: bytes) -> None:  # noqa: D102 - asyncio.Protocol
            if self._refused:  # answered and closing: nothing of it is parsed
                return
            super().data_received(data)

        def connection_lost(self, exc) -> None:  # noqa: D102 - asyncio.Protocol
            self._release()
            self._cancel()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self) -> None:  # noqa: D102 - the transport goes to another protocol
            self._release()
            self._cancel()
            super().handle_websocket_upgrade()

        def on_message_begin(self) -> None:  # noqa: D102 - parser callback
            super().on_message_begin()
            self._head_bytes = 0
            if self._phase is None:  # the first byte of the next request on a keep-alive connection
                self._enter("headers")

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > MAX_HEADER_BYTES:  # raised in a callback: uvicorn answers 400 and closes
                raise ValueError(f"request head over {MAX_HEADER_BYTES} bytes")

        def on_url(self, url: bytes) -> None:  # noqa: D102 - parser callback
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:  # noqa: D102 - parser callback
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:  # noqa: D102 - parser callback
            self._enter("body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:  # noqa: D102 - parser callback
            self._enter(None)
            super().on_message_complete()
else:  # pragma: no cover
    GuardedHttpToolsProtocol = None


def server_config(app, settings, log_level: str = "warning", **extra):
    """The ``uvicorn.Config`` of ``fedbroker serve api`` for ``app`` and ``settings`` (``api_host``,
    ``api_port``, ``api_certfile``/``api_keyfile`` for TLS, ``api_max_connections`` and
    ``api_max_connections_per_peer`` per process; no WebSocket: the API has no WebSocket route);
    ``extra``: more ``uvicorn.Config`` arguments (``workers``, ``factory`` with an import string ``app``).
    Raises ``ValueError`` naming the setting when only one of the TLS files is given or a file does not exist."""
    import uvicorn

    cert, key = settings.api_certfile, settings.api_keyfile
    if (cert is None) != (key is None):
        raise ValueError(f"api_certfile={str(cert) if cert else None!r}, api_keyfile={str(key) if key else None!r}: "
                         f"give both (TLS) or neither")
    for name, path in (("api_certfile", cert), ("api_keyfile", key)):
        if path is not None and not path.is_file():
            raise ValueError(f"{name}={str(path)!r}: no such file")
    cfg = uvicorn.Config(
        app, host=settings.api_host, port=settings.api_port, log_level=log_level, access_log=False,
        http=GuardedHttpToolsProtocol or GuardedH11Protocol, ws="none", timeout_keep_alive=KEEP_ALIVE_S,
        limit_concurrency=settings.api_max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=10,
        ssl_certfile=str(cert) if cert else None, ssl_keyfile=str(key) if key else None,
        log_config=None, **extra)  # uvicorn logs through the root handlers, so the secret filter (broker.service.redact) sees them
    # read by the guarded protocols (uvicorn hands them the config); an attribute pickles with the config to
    # the worker processes of --workers N
    cfg.fedbroker_max_connections_per_peer = int(getattr(settings, "api_max_connections_per_peer", 0))
    return cfg
