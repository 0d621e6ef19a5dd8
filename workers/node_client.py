"""The node agent's client of the node API (:mod:`broker.service.node_api`): HTTP(S) and a node token, nothing else.

The agent holds no database URL, no Redis URL and no admin token: only the API's URL and a
token that names its own node. Errors::

    NodeApiError            status (HTTP status or None), detail
     +-- NodeApiUnavailable cannot connect, timed out, or a 5xx answer: try again later
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

import requests

__all__ = ["NodeClient", "NodeApiError", "NodeApiUnavailable"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NodeApiError(Exception):
    """The node API refused a call (4xx): ``status`` is the HTTP status, ``detail`` the server's reason."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None):
        super().__init__(message)
        self.status = status
        self.detail = detail if detail is not None else message


class NodeApiUnavailable(NodeApiError):
    """The API could not be reached, timed out, or answered 5xx; the call may be retried."""


class NodeClient:
    """Calls ``/v1/node/...`` of the broker at ``api_url`` with ``token``.

    Args:
        api_url: the API's base URL (``https://broker.example:8000``).
        token: the node token (``fedbroker nodes token HOST``); never logged.
        timeout_s: connect and read timeout of each call, seconds.

    Raises ``ValueError`` for an ``api_url`` that is not ``https://`` (``http://`` only to a loopback address)
    or an empty token.
    """

    def __init__(self, api_url: str, token: str, timeout_s: float = 5.0):
        if not api_url.startswith(("http://", "https://")):
            raise ValueError(f"api_url={api_url!r}: must start with http:// or https://")
        host = (urlsplit(api_url).hostname or "").lower()
        if api_url.startswith("http://") and not (host == "localhost" or _loopback(host)):
            raise ValueError(f"api_url={api_url!r}: must be https:// (the node token would cross the network in "
                             "clear); http:// is only for a loopback address")
        if not token:
            raise ValueError("token='': a node token is required (FEDBROKER_NODE_TOKEN or --token-file)")
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = requests.Session()
        self._http.headers["Authorization"] = f"Bearer {token}"
        self._poll_http: requests.Session | None = None

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        url = f"{self.api_url}/v1/node{path}"
        try:
            r = self._http.request(method, url, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise NodeApiUnavailable(f"{method} {path}: {type(e).__name__}") from None
        if r.status_code >= 500:
            raise NodeApiUnavailable(f"{method} {path}: HTTP {r.status_code}", r.status_code)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:500]
            raise NodeApiError(f"{method} {path}: HTTP {r.status_code}: {detail}", r.status_code, detail)
        return r.json()

    def config(self) -> dict:
        """The agent-side settings: ``heartbeat_interval_s``, ``cancel_grace_s``, ``log_chunk_bytes``, ``log_max_bytes``."""
        return self._call("GET", "/config")

    def heartbeat(self, **inventory) -> dict:
        """Send the node's inventory and telemetry (fields of :class:`broker.service.node_api.NodeHeartbeat`)."""
        return self._call("POST", "/heartbeat", inventory)

    def work(self) -> list[dict]:
        """The ranks placed on this node of every starting or running job."""
        return self._call("GET", "/work")["work"]

    def work_changed(self, etag: str | None, wait_s: float) -> str | None:
        """Long-poll ``GET /work``: returns the ETag of this node's work as soon as it differs from
        ``etag``, or ``etag`` itself after ``wait_s`` seconds (0-10) without a change; ``None`` from an
        API that sends no ETag. Raises :class:`NodeApiError` like every call."""
        url = f"{self.api_url}/v1/node/work"
        headers = {"If-None-Match": etag} if etag else {}
        if self._poll_http is None:  # its own session: the long-poll runs in a thread of its own
            self._poll_http = requests.Session()
            self._poll_http.headers.update(self._http.headers)
        try:
            r = self._poll_http.get(url, params={"wait_s": wait_s} if etag else None, headers=headers,
                               timeout=(self.timeout_s, wait_s + self.timeout_s))
        except requests.RequestException as e:
            raise NodeApiUnavailable(f"GET /work: {type(e).__name__}") from None
        if r.status_code == 304:
            return etag
        if r.status_code >= 400:
            raise (NodeApiUnavailable if r.status_code >= 500 else NodeApiError)(
                f"GET /work: HTTP {r.status_code}", r.status_code)
        return r.headers.get("ETag")

    @staticmethod
    def _key(job_id: str, attempt: int, rank: int) -> str:
        return f"/attempts/{job_id}/{int(attempt)}/{int(rank)}"

    def running(self, job_id: str, attempt: int, rank: int) -> bool:
        """Report that the rank's process runs; returns whether the job moved to ``running``."""
        return self._call("POST", self._key(job_id, attempt, rank) + "/running")["changed"]

    def ended(self, job_id: str, attempt: int, rank: int, exit_code: int | None, stopped_why: str | None = None) -> bool:
        """Report the rank's end (``exit_code`` ``None``: lost; ``stopped_why``: this node stopped it, e.g. its time
        limit); returns whether the end is recorded."""
        body = {"exit_code": exit_code} if exit_code is not None else {"lost": True}
        if stopped_why:
            body["stopped_why"] = stopped_why[:2000]
        return self._call("POST", self._key(job_id, attempt, rank) + "/ended", body)["recorded"]

    def launch_failed(self, job_id: str, attempt: int, rank: int, reason: str) -> bool:
        """Report that the rank could not be started here, with ``reason`` (at most 2000 characters)."""
        return self._call("POST", self._key(job_id, attempt, rank) + "/launch-failed", {"reason": reason[:2000]})["changed"]

    def gone(self, job_id: str, attempt: int, rank: int) -> bool:
        """Report that this node has no process and no exit code for a rank shown running here."""
        return self._call("POST", self._key(job_id, attempt, rank) + "/gone")["changed"]

    def log(self, job_id: str, attempt: int, rank: int, seq: int, text: str) -> bool:
        """Ship log chunk ``seq`` of the rank (a chunk stored already is ignored)."""
        return self._call("POST", self._key(job_id, attempt, rank) + "/logs", {"seq": seq, "text": text})["stored"]
