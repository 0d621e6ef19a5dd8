"""Strict JSON request bodies: one key once per object, UTF-8 only, size-bounded.

Plain ``json.loads`` keeps the last of two equal keys (``{"gpus_per_node": 1, "gpus_per_node": 4}``
made a 4-GPU job) and FastAPI answers a body that is not UTF-8 with a bare 400. This module is the one
home of the rule for the API (:class:`StrictJsonBody`, an ASGI middleware), which reads each body with
:func:`broker.unique_keys.read_document`, the reader of every config file too (cluster, job, settings and
secrets files).
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from broker.unique_keys import DuplicateJsonKey, loads_strict, read_document, unique_json_object

__all__ = ["DuplicateJsonKey", "unique_json_object", "loads_strict", "utf8_error", "StrictJsonBody", "BodyLimit",
           "MAX_BODY_BYTES"]

#: largest request body accepted, bytes (a job spec's argv may hold up to 1 MiB)
MAX_BODY_BYTES = 2 * 1024 * 1024


def utf8_error(body: bytes, e: UnicodeDecodeError) -> str:
    """Where ``body`` stops being UTF-8: ``"not valid UTF-8 (byte 0xe9 at offset 26: invalid continuation byte)"``."""
    return f"not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start}: {e.reason})"


def _error(msg: str, kind: str, status: int = 422) -> JSONResponse:
    return JSONResponse({"detail": [{"loc": ["body"], "msg": msg, "type": kind}]}, status_code=status)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before it is parsed
    (by its Content-Length, or while it streams in, chunked, when it has none)."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = JSONResponse({"detail": f"request body: larger than {self.max_bytes} bytes"}, status_code=413)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await too_big(scope, receive, send)
                except ValueError:
                    pass
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge()
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await too_big(scope, receive, send)


def _is_json(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True  # FastAPI reads a body without Content-Type as JSON


class StrictJsonBody:
    """ASGI middleware under :class:`BodyLimit`: reads the whole body of a request before the route
    does (so an oversized chunked body is a 413, never a parse error), then, for a JSON body,
    answers 422 ``{"detail": [{"loc": ["body"], "msg": ..., "type": ...}]}`` when it is not UTF-8
    (``type`` ``"utf8_invalid"``, the byte and its offset in the message) or holds a key twice in one
    object (``"duplicate_key"``, the key named), nests too deeply for the parser (``"json_too_deep"``) or
    holds a number it cannot read (an integer of over 4300 digits: ``"json_invalid"``). Invalid JSON is left
    to FastAPI's own 422."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and _is_json(scope):
            try:
                read_document("body", body, as_json=True)
            except UnicodeDecodeError as e:
                return await _error(f"body: {utf8_error(body, e)}", "utf8_invalid")(scope, receive, send)
            except DuplicateJsonKey as e:
                return await _error(f"body: {e}", "duplicate_key")(scope, receive, send)
            except json.JSONDecodeError:
                pass  # not JSON: FastAPI says where
            except RecursionError:
                return await _error("body: nested too deeply to parse", "json_too_deep")(scope, receive, send)
            except ValueError as e:  # e.g. an integer of more than 4300 digits
                return await _error(f"body: cannot be parsed: {e}", "json_invalid")(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
