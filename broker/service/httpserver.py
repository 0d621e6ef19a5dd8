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

A reverse proxy in front (nginx ``client_header_timeout``/``client_body_timeout``) is the usual
production layout and does the same; these limits hold without one.
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "GuardedHttpToolsProtocol", "server_config", "HEADER_TIMEOUT_S", "BODY_TIMEOUT_S",
           "KEEP_ALIVE_S", "MAX_HEADER_BYTES"]

log = logging.getLogger("fedbroker.api.server")

#: seconds a request's headers may take to arrive, from the connection (or the first byte of the next request)
HEADER_TIMEOUT_S = 10.0
#: seconds a request's body may take to arrive, from the end of its headers
BODY_TIMEOUT_S = 30.0
#: seconds an idle keep-alive connection is kept between requests
KEEP_ALIVE_S = 5
#: largest request head (request line + headers), bytes; larger is a 400
MAX_HEADER_BYTES = 16 * 1024


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


class GuardedH11Protocol(_ReadDeadlines, H11Protocol):
    """uvicorn's h11 protocol with header and body read timeouts (class attributes, seconds; a
    subclass may change them): a request not read in time closes the connection."""

    def connection_made(self, transport) -> None:  # noqa: D102 - asyncio.Protocol
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:  # noqa: D102 - asyncio.Protocol
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc) -> None:  # noqa: D102 - asyncio.Protocol
        self._cancel()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """The phase h11 is in: reading a request's headers (IDLE) or its body (SEND_BODY), or neither."""
        state = self.conn.their_state
        self._enter("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is optional
    HttpToolsProtocol = None

if HttpToolsProtocol is not None:
    class GuardedHttpToolsProtocol(_ReadDeadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol (the faster parser) with the same read timeouts, and a request head
        over :data:`MAX_HEADER_BYTES` answered 400 (httptools has no limit of its own)."""

        _head_bytes = 0

        def connection_made(self, transport) -> None:  # noqa: D102 - asyncio.Protocol
            super().connection_made(transport)
            self._enter("headers")

        def connection_lost(self, exc) -> None:  # noqa: D102 - asyncio.Protocol
            self._cancel()
            super().connection_lost(exc)

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
    ``api_port``, ``api_certfile``/``api_keyfile`` for TLS, ``api_max_connections`` per process);
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
    return uvicorn.Config(
        app, host=settings.api_host, port=settings.api_port, log_level=log_level, access_log=False,
        http=GuardedHttpToolsProtocol or GuardedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=settings.api_max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=10,
        ssl_certfile=str(cert) if cert else None, ssl_keyfile=str(key) if key else None,
        log_config=None, **extra)  # uvicorn logs through the root handlers, so the secret filter (broker.service.redact) sees them
