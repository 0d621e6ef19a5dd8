"""The Python SDK of the broker's HTTP API (:mod:`broker.service.api`).

::

    from broker import Client
    c = Client()                          # FEDBROKER_API_URL / FEDBROKER_TOKEN, else the settings' api_url
    job = c.submit({"image": "ghcr.io/me/train:1", "gpus_per_node": 8, "estimated_duration_s": 7200})
    job = c.wait(job.id, timeout=3600)    # returns when succeeded, failed or cancelled
    print(c.logs(job.id))
    nightly = c.create_schedule("nightly", "0 2 * * *", {"gpus_per_node": 8, "slack_s": 21600},
                                timezone="Europe/London")   # a job every night at 02:00 London time
    march = c.usage_summary("2024-03-01", "2024-04-01", by="provider")   # USD, GPU-h, kWh, kgCO2e
    csv_text, skipped = c.usage_focus("2024-03-01", "2024-04-01")       # a FOCUS 1.2 CSV

Connection errors and 502/503/504 answers are retried with exponential backoff
(``retries`` times), POST included: :meth:`Client.submit` sends one idempotency key
per call (a fresh uuid4 unless given), so a submit whose answer was lost is
answered with the first job on retry and never creates two. Schedule names are unique per
team instead: a :meth:`Client.create_schedule` whose answer was lost answers
:class:`Conflict` on retry (the schedule exists; find it with :meth:`Client.schedules`).

A 429 (the team's submit rate or queued-jobs quota, :mod:`broker.service.limits`) is retried after the
server's ``Retry-After`` seconds, for at most ``max_rate_wait_s`` seconds of sleeping per call; then
:class:`RateLimited` is raised with ``retry_after``. :meth:`Client.submit_many` sends a sweep through
``POST /v1/jobs:batch`` in chunks of 1,000, one idempotency key per job.

Exceptions::

    BrokerError                 status (HTTP status or None), detail (the server's "detail")
     +-- AuthError              401 missing/unknown/revoked/expired token, 403 another team's resources
                                    or a token kind that may not (read-only writing, member managing tokens)
     +-- NotFound               404 no such job or schedule (or another team's)
     +-- ValidationFailed       422 bad input; .errors = [{"loc", "msg", "type", ...}]
     +-- Conflict               409 finished job cancelled, idempotency key reused with another spec,
                                    schedule name already taken
     +-- BrokerUnavailable      cannot connect (after retries), timeouts, 5xx
     +-- RateLimited            429 still refused after max_rate_wait_s; .retry_after (s), .limit
     +-- WaitTimeout            Client.wait() ran out of time; .job = the last JobView seen
     +-- UnexpectedAnswer       an answer a fedbroker API does not send (not JSON): the URL points elsewhere

Any other 4xx raises :class:`BrokerError` itself. An id put into a URL path (``job_id``, ``schedule_id``,
``token_id``) that is not of the server's format (broker.model's ``*_ID_PATTERN``) raises :class:`InvalidId`
(a ``ValueError`` naming the field and value) before any request; valid ids are still percent-encoded.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from urllib.parse import quote
from typing import Any, Iterable, Iterator

import requests
from pydantic import BaseModel
from pydantic_core import to_jsonable_python
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from broker.batch import MAX_BATCH_ITEMS, BatchItemResult
from broker.bulk_cancel import CancelManyResponse
from broker.model import JOB_ID_PATTERN, SCHEDULE_ID_PATTERN, TOKEN_ID_PATTERN, JobSpec
from broker.schemas import (AuditEventView, CreatedToken, ExplainView, JobView, LogsView, NodeView, ScheduleView,
                            TokenView, UsageSummaryView)
from broker.schemas import NodeCapacityView

__all__ = ["Client", "BrokerError", "AuthError", "NotFound", "ValidationFailed", "Conflict", "BrokerUnavailable",
           "WaitTimeout", "RateLimited", "UnexpectedAnswer", "BatchItemResult", "InvalidId"]


class BrokerError(Exception):
    """An error answered by (or on the way to) the broker.

    Attributes:
        status: HTTP status code, or ``None`` when there was no answer.
        detail: the server's ``detail`` (a message, or a list of validation errors), or our message.
    """

    def __init__(self, message: str, status: int | None = None, detail: Any = None):
        super().__init__(message)
        self.status = status
        self.detail = detail if detail is not None else message


class AuthError(BrokerError):
    """401 (missing, unknown or revoked token) or 403 (not allowed for this team)."""


class NotFound(BrokerError):
    """404: no such job or schedule, or one of another team."""


class ValidationFailed(BrokerError):
    """422: the request was rejected; ``errors`` lists ``{"loc", "msg", "type"}`` naming each field."""

    def __init__(self, message: str, status: int | None = 422, detail: Any = None, errors: list[dict] | None = None):
        super().__init__(message, status, detail)
        self.errors = errors or []


class Conflict(BrokerError):
    """409: the job already finished, the idempotency key was used with another spec, or the
    team already has a schedule of that name."""


class BrokerUnavailable(BrokerError):
    """The broker could not be reached after the retries, timed out, or answered 5xx."""


class RateLimited(BrokerError):
    """429: the team's submit rate (``quotas.submits_per_s``), queued-jobs quota (``quotas.max_queued_jobs``) or
    spec-bytes quota (``quotas.max_queued_spec_bytes``) still refused after the client waited ``max_rate_wait_s``
    in total.

    Attributes:
        retry_after: the server's last ``Retry-After``, seconds (``None`` if it sent none).
        limit: the dotted setting that refused (``"quotas.submits_per_s"``), or ``None``.
    """

    def __init__(self, message: str, status: int | None = 429, detail: Any = None, retry_after: float | None = None,
                 limit: str | None = None):
        super().__init__(message, status, detail)
        self.retry_after = retry_after
        self.limit = limit


class UnexpectedAnswer(BrokerError):
    """The server answered with something a fedbroker API does not send (not JSON, or JSON of another shape):
    ``FEDBROKER_API_URL`` (or ``url``) points at something else."""


class WaitTimeout(BrokerError):
    """:meth:`Client.wait` gave up; ``job`` is the last :class:`JobView` seen."""

    def __init__(self, message: str, job: JobView):
        super().__init__(message, None, message)
        self.job = job


_RETRY_STATUS = (502, 503, 504)


class _Retry(Retry):
    """urllib3's retries without its own handling of 429 (and 413) ``Retry-After``: :meth:`Client._request`
    waits out a 429 itself, within ``max_rate_wait_s``, and raises :class:`RateLimited` past it."""

    RETRY_AFTER_STATUS_CODES = frozenset({503})


class Client:
    """A client of one broker.

    Args:
        url: base URL of the API (default: ``$FEDBROKER_API_URL``, else
            :attr:`broker.service.settings.BrokerSettings.effective_api_url`).
        token: API token (default: ``$FEDBROKER_TOKEN``); sent as ``Authorization: Bearer``.
        timeout: seconds to wait for each HTTP answer.
        retries: retries of connection errors, read errors and 502/503/504 per call
            (backoff 0, 0.4, 0.8, ... s, at most 10 s).
        max_rate_wait_s: seconds one call may sleep in total on 429 answers (each sleep is the answer's
            ``Retry-After``); ``0`` = raise :class:`RateLimited` at the first 429.

    Raises ``ValueError`` naming ``url`` or ``token`` when they cannot be right.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0, retries: int = 5,
                 max_rate_wait_s: float = 120.0):
        if url is None:
            url = os.environ.get("FEDBROKER_API_URL")
        if url is None:
            from broker.service.settings import load_settings

            url = load_settings().effective_api_url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r}: not an http:// or https:// URL of the broker API")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("FEDBROKER_TOKEN")
        if self.token is not None and not (self.token.isascii() and self.token.isprintable() and " " not in self.token):
            raise ValueError("token: not a fedbroker API token (printable ASCII without spaces, e.g. 'fbk_...')")
        self.timeout = timeout
        if not max_rate_wait_s >= 0:
            raise ValueError(f"max_rate_wait_s={max_rate_wait_s!r}: must be >= 0 seconds")
        self.max_rate_wait_s = float(max_rate_wait_s)
        retry = _Retry(total=retries, connect=retries, read=retries, status=retries, other=0,
                      allowed_methods=None,  # every method: POST /v1/jobs is idempotent by its key
                      status_forcelist=_RETRY_STATUS, backoff_factor=0.2, backoff_max=10.0,
                      raise_on_status=False, respect_retry_after_header=True)
        self.session = requests.Session()
        adapter = HTTPAdapter(max_retries=retry)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers["Accept"] = "application/json"
        self.session.headers["User-Agent"] = "fedbroker-sdk/1"
        if self.token:
            self.session.headers["Authorization"] = f"Bearer {self.token}"
        # calls that must not be sent twice (a token create or rotate: the first answer holds the only copy of
        # the secret) retry only connection errors, where the request never left
        self._once = requests.Session()
        once = HTTPAdapter(max_retries=Retry(total=retries, connect=retries, read=0, status=0, other=0,
                                             allowed_methods=None, raise_on_status=False))
        self._once.mount("http://", once)
        self._once.mount("https://", once)
        self._once.headers.update(self.session.headers)

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self.session.close()
        self._once.close()

    # ------------------------------------------------------------------ transport
    def _request(self, method: str, path: str, *, params: Any = None, json: Any = None,
                 headers: dict | None = None, once: bool = False, with_headers: bool = False) -> Any:
        """Send one request (with retries; ``once``: only connection errors are retried; 429 answers are
        waited out for up to ``max_rate_wait_s``) and return the decoded JSON body (``None`` for 204 or
        an empty body; ``with_headers``: ``(body, response headers)``); raise the typed error otherwise."""
        waited = 0.0
        while True:
            r = self._send(method, path, params, json, headers, once)
            if r.status_code != 429:
                break
            after = _retry_after(r)
            if after is None or waited + after > self.max_rate_wait_s:
                err = _error_for(r)
                try:
                    limit = r.json().get("limit")
                except (ValueError, AttributeError):
                    limit = None
                waited_note = f" (after waiting {waited:g} s)" if waited else ""
                raise RateLimited(f"{err}{waited_note}", 429, err.detail, after, limit)
            time.sleep(after)
            waited += after
        if r.status_code < 400:
            if r.status_code == 204 or not r.content:
                return (None, r.headers) if with_headers else None
            try:
                return (r.json(), r.headers) if with_headers else r.json()
            except ValueError:
                raise UnexpectedAnswer(f"{method} {self.url}{path}: answered {r.status_code} with a body that is not "
                                       f"JSON ({_short_body(r)}): is this a fedbroker API?", r.status_code) from None
        raise _error_for(r)

    def _send(self, method: str, path: str, params: Any, json: Any, headers: dict | None,
              once: bool = False) -> requests.Response:
        """One request through the session (its connection/5xx retries; ``once``: connection retries only);
        transport errors as typed errors."""
        try:
            return (self._once if once else self.session).request(method, self.url + path, params=params, json=json,
                                                                  headers=headers, timeout=self.timeout)
        except requests.exceptions.Timeout as e:
            raise BrokerUnavailable(f"the broker at {self.url} did not answer {method} {path} "
                                    f"within {self.timeout:g} s ({e})") from e
        except requests.exceptions.ConnectionError as e:
            raise BrokerUnavailable(f"cannot reach the broker at {self.url} ({_root_cause(e)})") from e
        except requests.exceptions.InvalidJSONError as e:  # e.g. NaN or infinity in a dict spec
            raise ValidationFailed(f"request body: cannot be sent as JSON ({e})", status=None) from e
        except requests.exceptions.RequestException as e:  # bad URL and the like
            raise BrokerError(f"{method} {self.url}{path}: {e}") from e

    # ------------------------------------------------------------------ jobs
    def submit(self, spec: JobSpec | dict, idempotency_key: str | None = None) -> JobView:
        """Submit a job; returns it in state ``submitted``.

        Args:
            spec: a :class:`JobSpec` or a mapping of its fields (validated by the server).
            idempotency_key: reuse it to make a repeated submit return the first job
                (default: a fresh uuid4 per call, which still makes this call's retries safe).
        Raises: :class:`ValidationFailed` (bad spec, deadline not in the future),
            :class:`Conflict` (key reused with another spec), :class:`AuthError`, :class:`BrokerUnavailable`.
        """
        key = idempotency_key or str(uuid.uuid4())
        data = self._request("POST", "/v1/jobs", json={"spec": _spec_body(spec), "idempotency_key": key})
        return _parse(JobView, data)

    def submit_many(self, specs: Iterable[JobSpec | dict], keys: Iterable[str] | None = None,
                    chunk: int = MAX_BATCH_ITEMS) -> list[BatchItemResult]:
        """Submit many jobs (a sweep) through ``POST /v1/jobs:batch``, ``chunk`` items per request.

        Args:
            specs: :class:`JobSpec` objects or mappings of their fields.
            keys: one idempotency key per spec (reuse them to make a repeated sweep return the first
                jobs); default: a fresh uuid4 per job, which still makes this call's retries safe.
            chunk: items per request, 1-1000.
        Returns:
            one :class:`broker.batch.BatchItemResult` per spec, in order (``index`` counts over all specs):
            ``status`` 201 created / 200 existing (``job`` set) or 403/409/422 (``detail``; nothing stored
            for that item: a bad item does not stop the others).
        Raises: :class:`RateLimited` (a chunk still refused after ``max_rate_wait_s``; earlier chunks are
            stored), :class:`ValidationFailed` (``keys`` and ``specs`` differ in length, or a bad chunk),
            :class:`AuthError`, :class:`BrokerUnavailable`. ``ValueError`` for ``chunk`` outside 1-1000.
        """
        if not 1 <= chunk <= MAX_BATCH_ITEMS:
            raise ValueError(f"chunk={chunk!r}: must be in [1, {MAX_BATCH_ITEMS}]")
        bodies = [_spec_body(sp) for sp in specs]
        key_list = [str(uuid.uuid4()) for _ in bodies] if keys is None else list(keys)
        if len(key_list) != len(bodies):
            raise ValidationFailed(f"keys: {len(key_list)} keys for {len(bodies)} specs", status=None)
        out: list[BatchItemResult] = []
        for start in range(0, len(bodies), chunk):
            items = [{"spec": b, "idempotency_key": k}
                     for b, k in zip(bodies[start:start + chunk], key_list[start:start + chunk])]
            data = self._request("POST", "/v1/jobs:batch", json={"items": items})
            results = data.get("results") if isinstance(data, dict) else None
            for res in _parse_list(BatchItemResult, results):
                out.append(res.model_copy(update={"index": res.index + start}))
        return out

    def get(self, job_id: str) -> JobView:
        """One job. Raises :class:`NotFound`."""
        return _parse(JobView, self._request("GET", f"/v1/jobs/{_seg('job_id', job_id)}"))

    def list(self, team: str | None = None, state: str | Iterable[str] | None = None, limit: int = 100,
             offset: int = 0, name: str | None = None) -> list[JobView]:
        """Jobs newest first, optionally of one ``team`` (admins), in the given state(s) and of exactly ``name``, at
        most ``limit``
        (1-1000). A page the server cut at its ``api_list_max_bytes`` of specs (its ``X-Next-Offset`` header) is
        followed by the next one, until ``limit`` jobs or the end."""
        out: list[JobView] = []
        while True:
            params: list[tuple[str, Any]] = [("limit", limit - len(out)), ("offset", offset)]
            if team is not None:
                params.append(("team", team))
            if state is not None:
                params += [("state", s) for s in ([state] if isinstance(state, str) else state)]
            if name is not None:
                params.append(("name", name))
            data, headers = self._request("GET", "/v1/jobs", params=params, with_headers=True)
            page = _parse_list(JobView, data)
            out += page
            nxt = headers.get("X-Next-Offset")
            if not page or nxt is None or len(out) >= limit or not nxt.isdigit() or int(nxt) <= offset:
                return out
            offset = int(nxt)

    def cancel(self, job_id: str) -> JobView:
        """Cancel a job (a running job gets ``cancel_requested``). Raises :class:`Conflict` if it already finished."""
        return _parse(JobView, self._request("POST", f"/v1/jobs/{_seg('job_id', job_id)}/cancel"))

    def cancel_many(self, *, all: bool = False, state: str | Iterable[str] | None = None, name: str | None = None,
                    team: str | None = None, limit: int | None = None) -> CancelManyResponse:
        """Cancel many jobs of one team in one request (``POST /v1/jobs:cancel``, :mod:`broker.bulk_cancel`):
        every unfinished job (``all=True``), or those in ``state`` (one or several) and/or named ``name``
        (filters AND-ed). Returns the ids now ``cancelled`` and ``cancel_requested`` and their ``count``;
        ``more`` when jobs matched past ``limit`` (default: the server's, 100,000). ``team``: only an admin
        names another team (and must name one). Raises :class:`ValidationFailed` for an empty filter or a
        finished state, :class:`AuthError` for another team."""
        body: dict[str, Any] = {"all": bool(all)}
        if state is not None:
            body["states"] = [state] if isinstance(state, str) else list(state)
        if name is not None:
            body["name"] = name
        if team is not None:
            body["team"] = team
        if limit is not None:
            body["limit"] = limit
        return _parse(CancelManyResponse, self._request("POST", "/v1/jobs:cancel", json=body))

    def wait(self, job_id: str, timeout: float = 600, poll_s: float = 0.5,
             on_change: Callable[[JobView], None] | None = None) -> JobView:
        """Poll until the job is succeeded, failed or cancelled and return it.

        ``on_change(view)`` is called with the first view and with every later one whose state or reason differs
        from the one before (``fedbroker submit --wait`` prints the job's history from it as it happens); an
        exception from it propagates. Raises :class:`WaitTimeout` (with ``.job``, the last view) after
        ``timeout`` seconds.
        """
        end = time.monotonic() + timeout
        seen = None
        while True:
            job = self.get(job_id)
            if on_change is not None and (job.state, job.reason) != seen:
                seen = (job.state, job.reason)
                on_change(job)
            if job.done:
                return job
            left = end - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"job {job_id} still {job.state} after {timeout:g} s", job)
            time.sleep(min(poll_s, left))

    def logs(self, job_id: str, attempt: int | None = None, rank: int = 0) -> str:
        """Captured stdout+stderr of an attempt (default: the latest) and rank; ``""`` before the first attempt."""
        return self.logs_view(job_id, attempt, rank).text

    def logs_view(self, job_id: str, attempt: int | None = None, rank: int = 0) -> LogsView:
        """Like :meth:`logs`, with the attempt number and the ``truncated`` flag."""
        params: dict[str, Any] = {"rank": rank}
        if attempt is not None:
            params["attempt"] = attempt
        return _parse(LogsView, self._request("GET", f"/v1/jobs/{_seg('job_id', job_id)}/logs", params=params))

    def follow_logs(self, job_id: str, attempt: int | None = None, rank: int = 0,
                    poll_s: float = 1.0) -> Iterator[LogsView]:
        """Follow one attempt's log while it grows: yields a :class:`LogsView` whose ``text`` is only what is new
        since the last one (first the whole log so far), polling every ``poll_s`` seconds (a poll that finds
        nothing new yields nothing), and returns once the job is finished (succeeded, failed, cancelled) or has
        moved on to a later attempt, after yielding that attempt's last text. ``attempt`` ``None`` follows the
        latest attempt at the first poll that finds one (a job waiting for its first attempt is waited for).
        Each poll is two requests: the job, then ``GET .../logs?offset=`` with the characters already yielded;
        the node agent ships an attempt's last bytes before it reports the exit, so the text read after a
        finished state is the whole log. Raises what :meth:`get` and :meth:`logs_view` raise."""
        pos = 0
        while True:
            job = self.get(job_id)
            params: dict[str, Any] = {"rank": rank, "offset": pos}
            if attempt is not None:
                params["attempt"] = attempt
            view = _parse(LogsView, self._request("GET", f"/v1/jobs/{_seg('job_id', job_id)}/logs", params=params))
            if attempt is None and view.attempt:
                attempt = view.attempt
            pos += len(view.text)
            if view.text:
                yield view
            if job.done or (attempt is not None and job.attempt > attempt):
                return
            time.sleep(poll_s)

    def explain(self, job_id: str) -> ExplainView:
        """The planner's latest decision for the job (chosen option, alternatives), its history and attempts."""
        return _parse(ExplainView, self._request("GET", f"/v1/jobs/{_seg('job_id', job_id)}/explain"))

    def nodes(self) -> list[NodeView] | list[NodeCapacityView]:
        """An admin token: the on-prem nodes as their agents last reported them (:class:`NodeView`); any other: the
        free capacity per pool and GPU type only (:class:`NodeCapacityView`)."""
        data = self._request("GET", "/v1/nodes")
        detail = isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "name" in data[0]
        return _parse_list(NodeView if detail else NodeCapacityView, data)

    # ------------------------------------------------------------------ schedules
    def create_schedule(self, name: str, cron: str, spec: JobSpec | dict, timezone: str = "UTC") -> ScheduleView:
        """Create a recurring run: at every fire of ``cron``, read in ``timezone``'s local
        wall-clock time, the broker submits ``spec`` as a job of your team.

        Args:
            name: unique within your team; 1-200 letters, digits, ``.``, ``_`` or ``-``.
            cron: 5-field cron expression (``"0 2 * * *"``) or a macro (``"@daily"``).
            spec: a :class:`JobSpec` or a mapping of its fields, without absolute instants
                (``deadline``, ``earliest_start``/``not_before``, ``not_after``): each run's
                deadline is its fire instant + ``estimated_duration_s`` + ``slack_s``.
            timezone: IANA zone name (``"Europe/London"``); DST rules in :mod:`broker.recurring`.

        Returns:
            ScheduleView: enabled, with ``next_fire_at`` (UTC) the first fire after now.

        Raises: :class:`ValidationFailed` (bad name, cron or time zone, or an absolute instant in
            the spec; ``errors`` name each field), :class:`Conflict` (name already used by your team,
            also when a retry follows a lost answer), :class:`AuthError`, :class:`BrokerUnavailable`.
        """
        body = {"name": name, "cron": cron, "timezone": timezone, "spec": _spec_body(spec)}
        return _parse(ScheduleView, self._request("POST", "/v1/schedules", json=body))

    def schedules(self, team: str | None = None) -> list[ScheduleView]:
        """Your team's schedules (an admin: every team's, or ``team``'s), by team then name."""
        params = {"team": team} if team is not None else None
        return _parse_list(ScheduleView, self._request("GET", "/v1/schedules", params=params))

    def get_schedule(self, schedule_id: str) -> ScheduleView:
        """One schedule. Raises :class:`NotFound` (also for another team's)."""
        return _parse(ScheduleView, self._request("GET", f"/v1/schedules/{_seg('schedule_id', schedule_id)}"))

    def pause_schedule(self, schedule_id: str) -> ScheduleView:
        """Pause a schedule: no jobs until resumed (a no-op if paused). Raises :class:`NotFound`."""
        return _parse(ScheduleView, self._request("POST", f"/v1/schedules/{_seg('schedule_id', schedule_id)}/pause"))

    def resume_schedule(self, schedule_id: str) -> ScheduleView:
        """Resume a paused schedule; its next fire is the first after now (fires missed while paused
        are skipped). A no-op if enabled. Raises :class:`NotFound`."""
        return _parse(ScheduleView, self._request("POST", f"/v1/schedules/{_seg('schedule_id', schedule_id)}/resume"))

    def delete_schedule(self, schedule_id: str) -> None:
        """Delete a schedule; the jobs it already created stay. Raises :class:`NotFound`
        (also when a retry follows a lost answer: the first try deleted it)."""
        self._request("DELETE", f"/v1/schedules/{_seg('schedule_id', schedule_id)}")

    # ------------------------------------------------------------------ tokens and audit
    def create_token(self, team: str | None = None, kind: str = "member", label: str = "",
                     ttl_s: int | None = None, node: str | None = None) -> CreatedToken:
        """Create an API token (needs an admin token, or a team-admin token for ``member``/``read-only``
        tokens of its own team). ``ttl_s``: lifetime in seconds (60 .. 3650 days; default the broker's
        ``token_ttl_days``); ``node``: the node of a ``node`` token. Returns it with its secret
        (``.token``), shown this once; not retried after the request was sent (a lost answer loses the
        secret: revoke that token and create another).

        Raises: :class:`AuthError` (403: your token kind may not), :class:`ValidationFailed` (bad team,
        kind, node, label or ttl), :class:`BrokerUnavailable`."""
        body: dict[str, Any] = {"kind": kind, "label": label}
        for k, v in (("team", team), ("ttl_s", ttl_s), ("node", node)):
            if v is not None:
                body[k] = v
        return _parse(CreatedToken, self._request("POST", "/v1/tokens", json=body, once=True))

    def tokens(self, team: str | None = None, include_revoked: bool = False) -> list[TokenView]:
        """Tokens (never their secrets): an admin sees every team's (or ``team``'s), a team admin its own
        team's. Raises :class:`AuthError` (403 for other kinds)."""
        params: dict[str, Any] = {"include_revoked": str(include_revoked).lower()}
        if team is not None:
            params["team"] = team
        return _parse_list(TokenView, self._request("GET", "/v1/tokens", params=params))

    def revoke_token(self, token_id: str) -> TokenView:
        """Revoke a token (``tok-...``): it answers 401 from now on; a no-op if already revoked.
        Raises :class:`NotFound`, :class:`AuthError`."""
        return _parse(TokenView, self._request("POST", f"/v1/tokens/{_seg('token_id', token_id)}/revoke"))

    def rotate_token(self, token_id: str, ttl_s: int | None = None) -> CreatedToken:
        """Replace a token: a new id and secret (``.token``, shown once) with the same kind, team and label,
        a new expiry; the old token is revoked. Not retried after the request was sent. Raises
        :class:`NotFound`, :class:`AuthError`, :class:`Conflict` (already revoked), :class:`ValidationFailed`."""
        body = {"ttl_s": ttl_s} if ttl_s is not None else None
        return _parse(CreatedToken, self._request("POST", f"/v1/tokens/{_seg('token_id', token_id)}/rotate", json=body,
                                                         once=True))

    def audit(self, since: Any = None, action: str | None = None, limit: int = 100) -> list[AuditEventView]:
        """The audit log, newest first (admin tokens): events at or after ``since`` (an aware datetime or
        ISO 8601 string), of one ``action`` (e.g. ``"token.revoke"``), at most ``limit`` (1-1000)."""
        params: dict[str, Any] = {"limit": limit}
        if since is not None:
            params["since"] = since.isoformat() if hasattr(since, "isoformat") else since
        if action is not None:
            params["action"] = action
        return _parse_list(AuditEventView, self._request("GET", "/v1/audit", params=params))

    # ------------------------------------------------------------------ usage ledger (issue #12)
    def usage_summary(self, start: Any, end: Any, by: str = "team", team: str | None = None) -> UsageSummaryView:
        """``GET /v1/usage/summary``: USD, GPU-hours, kWh and kgCO2e of the ledger lines that start in
        ``[start, end)`` (aware datetimes or ISO 8601 strings, UTC), grouped ``by`` team, project, provider,
        region, pool or day; ``team``: one team (team tokens: their own only). Raises :class:`ValidationFailed`
        (422 naming ``by``, ``from`` or ``to``), :class:`AuthError` (401/403)."""
        params = {"from": _instant(start), "to": _instant(end), "by": by, **({"team": team} if team else {})}
        return _parse(UsageSummaryView, self._request("GET", "/v1/usage/summary", params=params))

    def usage_focus(self, start: Any, end: Any, team: str | None = None) -> tuple[str, int]:
        """``GET /v1/usage/focus``: the ledger lines that start in ``[start, end)`` as a FOCUS 1.2 CSV; returns
        ``(csv text, lines left out because their cost is unknown)``. Errors as :meth:`usage_summary`."""
        params = {"from": _instant(start), "to": _instant(end), **({"team": team} if team else {})}
        r = self._send("GET", "/v1/usage/focus", params, None, None)
        if r.status_code >= 400:
            raise _error_for(r)
        return r.text, int(r.headers.get("X-Fedbroker-Skipped-Lines", "0"))

    def health(self) -> dict:
        """``GET /healthz``: ``{"status": "ok", "database": "ok", "redis": "ok"}``.

        Raises :class:`BrokerUnavailable` if the database (or the API) is down."""
        return self._request("GET", "/healthz")


#: the id formats the API accepts in a path (one home: broker.model), by the SDK's argument name
_PATH_IDS = {"job_id": re.compile(JOB_ID_PATTERN), "schedule_id": re.compile(SCHEDULE_ID_PATTERN),
             "token_id": re.compile(TOKEN_ID_PATTERN)}


class InvalidId(ValueError):
    """An id given to the SDK is not of the server's id format (e.g. ``../tokens/tok-.../revoke?``); raised
    before any request is sent. ``field`` (``job_id``, ``schedule_id``, ``token_id``) and ``value`` name it."""

    def __init__(self, field: str, value: Any):
        self.field, self.value = field, value
        super().__init__(f"{field}={value!r}: not a {field.removesuffix('_id')} id "
                         f"(expected {_PATH_IDS[field].pattern.strip('^$')})")


def _seg(field: str, value: Any) -> str:
    """``value`` as one URL path segment: checked against the server's id format for ``field`` (a key of
    :data:`_PATH_IDS`) and percent-encoded (``quote(..., safe="")``, defence in depth). Raises :class:`InvalidId`."""
    if not isinstance(value, str) or not _PATH_IDS[field].fullmatch(value):
        raise InvalidId(field, value)
    return quote(value, safe="")


def _instant(t: Any) -> str:
    """An aware datetime (or a string, sent as is) as an ISO 8601 query value."""
    return t.isoformat() if hasattr(t, "isoformat") else str(t)


def _spec_body(spec: JobSpec | dict) -> dict:
    """A job spec as JSON for a request body: a :class:`JobSpec`'s fields that were set, or the mapping."""
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json", exclude_unset=True)
    return to_jsonable_python(dict(spec))


#: the shortest wait on a 429 answer, seconds: a ``Retry-After`` of 0, below 0, NaN or a past date would resend at
#: once, in a loop (2,490 requests in 3 s against a server answering ``Retry-After: -5``)
MIN_RETRY_AFTER_S = 1.0


def _retry_after(r: requests.Response) -> float | None:
    """The ``Retry-After`` of an answer in seconds, at least :data:`MIN_RETRY_AFTER_S` (delta-seconds form; an
    HTTP date is read too), or ``None``."""
    raw = r.headers.get("Retry-After")
    if raw is None:
        return None
    try:
        wait = float(raw)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            wait = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return wait if wait >= MIN_RETRY_AFTER_S else MIN_RETRY_AFTER_S  # NaN too


def _root_cause(e: BaseException) -> str:
    """The innermost reason of a requests/urllib3 connection error (e.g. ``[Errno 111] Connection refused``)."""
    cause = e
    for _ in range(10):
        nxt = getattr(cause, "reason", None)
        if not isinstance(nxt, BaseException):
            nxt = cause.__cause__ or cause.__context__
        if nxt is None or nxt is cause:
            break
        cause = nxt
    return str(cause) or type(cause).__name__


def _parse(model, data: Any):
    """``model.model_validate(data)`` of an answer; :class:`UnexpectedAnswer` when it is not of that shape."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        loc = ".".join(map(str, e.errors()[0].get("loc", ()))) or "the body"
        raise UnexpectedAnswer(f"an answer that is not a {model.__name__} ({e.error_count()} field(s) not as "
                               f"expected, e.g. {loc!r}): is this a fedbroker API of this version?") from None


def _parse_list(model, data: Any) -> list:
    """:func:`_parse` of each item of a list answer."""
    if not isinstance(data, list):
        raise UnexpectedAnswer(f"an answer that is not a list of {model.__name__}: is this a fedbroker API?")
    return [_parse(model, x) for x in data]


def _short_body(r: requests.Response, limit: int = 200) -> str:
    """An answer's text for a message, whitespace folded and cut to ``limit`` characters (an HTML error page is
    kilobytes)."""
    text = " ".join(r.text.split()) or str(r.reason)
    return text if len(text) <= limit else text[:limit] + "..."


def _error_for(r: requests.Response) -> BrokerError:
    """The typed exception of an error response."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = _short_body(r)
    if isinstance(detail, list):
        message = "; ".join(str(e.get("msg", e)) if isinstance(e, dict) else str(e) for e in detail)
    else:
        message = str(detail)
    message = f"{r.status_code} {message}"
    code = r.status_code
    if code == 422:
        return ValidationFailed(message, code, detail, detail if isinstance(detail, list) else [])
    if code in (401, 403):
        return AuthError(message, code, detail)
    if code == 404:
        return NotFound(message, code, detail)
    if code == 409:
        return Conflict(message, code, detail)
    if code >= 500:
        return BrokerUnavailable(message, code, detail)
    return BrokerError(message, code, detail)
