"""Instance reports: what a cloud instance says about its rank, and the per-rank tokens it says it with.

The instance's user data (:func:`providers.launch.cloud_init`) reports to ``POST /v1/instances/report``:
``running`` -> the job runs; ``notice`` (spot/preemption) -> ``stop_reason="spot"``, the gang checkpoints and
stops; ``exited(code)`` -> the rank's end, decided by :func:`broker.service.lifecycle.rank_ended` (succeeded /
failed with the failing rank's code / requeued from its checkpoint; a rank that fails, or ends after a
notice, stops the others by shutting their instances down - SIGTERM, checkpoint, upload, report - and the
attempt ends when every rank has reported, or ``stop_window`` after the first stop: see :mod:`.watch`).

A job stopped by a spot notice is requeued whatever its exit code: exit 0 after SIGTERM usually means
"checkpointed", not "finished" (the on-prem agent treats a preempted job the same way).

Instances authenticate their reports with a per-(job, attempt, rank) token: HMAC-SHA256 of
``job|attempt|rank`` under a random key kept in the database
(:meth:`broker.service.store.core.JobStore.instance_secret`). It only lets an instance report on its own
rank of its own attempt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from datetime import datetime, timedelta

from broker.service import lifecycle
from broker.service.lifecycle import Place
from broker.service.store import attempts as jobs
from broker.service.store import cloud as instances
from broker.service.store.tables import utcnow
from broker.states import JobState

__all__ = ["REPORT_EVENTS", "LOG_TAIL_MAX", "ReportError", "report_token", "Reports"]

log = logging.getLogger("fedbroker.cloud")
S = JobState
#: events an instance reports (see providers.launch.cloud_init)
REPORT_EVENTS = ("running", "notice", "exited")
#: bytes of an instance's exit report log tail kept
LOG_TAIL_MAX = 65536


class ReportError(ValueError):
    """A report that cannot be taken: ``status`` 401 (bad token), 404 (no such instance), 422 (bad field)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def report_token(secret: bytes, job_id: str, attempt: int, rank: int) -> str:
    """The report token of one rank of one attempt: 43 URL-safe characters (HMAC-SHA256, base64url)."""
    mac = hmac.new(secret, f"{job_id}|{attempt}|{rank}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


class Reports:
    """The reports part of :class:`broker.service.cloud.CloudBroker`; needs ``self.store``, ``self.settings``,
    ``self._secret`` (``None`` until read), and the other parts' :meth:`mark_attempt`, :meth:`teardown` and
    :meth:`request_teardown`."""

    # ------------------------------------------------------------------ tokens
    @property
    def secret(self) -> bytes:
        """The key of the report tokens (32 bytes, from the database; read once per process)."""
        if self._secret is None:
            self._secret = self.store.instance_secret()
        return self._secret

    def token(self, job_id: str, attempt: int, rank: int) -> str:
        """The report token of one rank of one attempt (see :func:`report_token`)."""
        return report_token(self.secret, job_id, attempt, rank)

    def check_token(self, job_id: str, attempt: int, rank: int, token: str) -> bool:
        """Whether ``token`` is the report token of that rank of that attempt (constant-time compare)."""
        return hmac.compare_digest(self.token(job_id, attempt, rank).encode(), (token or "").encode())

    # ------------------------------------------------------------------ reports
    @property
    def stop_window(self) -> timedelta:
        """How long the other ranks of a stopping gang have to checkpoint and report before the attempt is ended
        without them: the container's grace plus 3 minutes (an instance's shutdown, the checkpoint upload)."""
        return timedelta(seconds=self.settings.cloud.notice_grace_s + 180.0)

    def report(self, job_id: str, attempt: int, rank: int, event: str, exit_code: int | None = None,
               reason: str = "", log_tail: str = "", now: datetime | None = None, seq: int | None = None) -> str:
        """Take one instance report (the token was checked by the caller). Returns the outcome; asks for the
        attempt's instances to be torn down when the attempt has ended. Raises :class:`ReportError` (404 for an
        unknown rank of the attempt, 422 for an unknown event).

        ``seq``: the report's sequence number (the instance's user data counts its reports from 1). A report
        whose ``seq`` is not above the highest one taken from this rank's instance is a replay (or a retry of
        a report that was taken): it changes nothing, appends no log, and the outcome is ``"duplicate"``.
        ``None`` (in-process callers) skips the check."""
        if event not in REPORT_EVENTS:
            raise ReportError(422, f"event={event!r}: must be one of {', '.join(REPORT_EVENTS)}")
        now = now or utcnow()
        ended = False
        stop_ranks: list[int] = []
        out = "ok"
        claimed = seq is None
        for _ in range(10):
            with self.store.session() as s:
                row = instances.report_row(s, job_id, attempt, rank)
                if row is None:
                    raise ReportError(404, f"no instance of job {job_id} attempt {attempt} rank {rank}")
                j = jobs.job_row(s, job_id)
                att = jobs.attempt_row(s, job_id, attempt, lock=True)
                if j is None or att is None:
                    raise ReportError(404, f"no attempt {attempt} of job {job_id}")
                if not claimed:  # one atomic compare-and-set: two copies of one report cannot both pass
                    claimed = instances.claim_report_seq(s, row.id, seq)
                    if not claimed:
                        log.warning("instance report of job %s attempt %s rank %s: seq %s already taken; "
                                    "a replay or a retry, ignored", job_id, attempt, rank, seq)
                        return "duplicate"
                where = f"rank {rank} on {row.provider}/{row.provider_instance_id}"
                if j.attempt != attempt or j.state not in (S.starting.value, S.running.value):
                    ended = True  # a stale report changes nothing, but its instance must go
                    out = "stale"
                    break
                instances.note_report(row, event, now)
                if event == "notice" and (j.placement or {}).get("market") != "spot":
                    out = "ignored: a notice from an instance that is not spot"
                    break
                if j.state == S.starting.value and event in ("running", "exited"):
                    if not lifecycle.mark_running(s, j, att, now, f"running ({where})"):
                        continue
                if event == "running":
                    out = "running"
                    break
                if event == "notice":
                    if not j.stop_reason and not j.cancel_requested:
                        why = (f"spot interruption notice for {where}" + (f" ({reason})" if reason else "")
                               + "; the job checkpoints and stops")
                        if not jobs.bump_with_event(s, j, now, why, stop_reason="spot",
                                                    state_deadline_at=now + self.stop_window):
                            continue
                        self.mark_attempt(s, job_id, attempt, f"Reclaimed: {why}", now)
                    out = "notice"
                    break
                # exited
                end = lifecycle.rank_ended(s, j, att, rank, exit_code, now, Place.instance(where),
                                           max_attempts=self.settings.max_attempts, stop_window=self.stop_window)
                if end.retry:
                    continue
                out, ended, stop_ranks = end.outcome, end.ended, end.stop_ranks
                break
        if event == "exited" and log_tail:  # after the sequence check: a replayed exit appends nothing
            self.store.append_log(job_id, attempt, rank, 0, "[fedbroker: the last bytes of the container's log, "
                                  "sent by the instance when it exited]\n" + log_tail[-LOG_TAIL_MAX:])
        if ended:
            self.request_teardown(job_id, attempt)
        elif stop_ranks:
            self.teardown(job_id, attempt, "stopped: another rank of the gang ended", ranks=stop_ranks)
        return out
