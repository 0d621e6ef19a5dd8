"""The attempt lifecycle of on-prem attempts, on the service side (DESIGN.md §3).

Node agents hold no database credential: they report what their host saw through the node
API (:mod:`broker.service.node_api`), and these functions turn each report into job-state moves with
compare-and-set on the job's version:

* :func:`node_work` — the attempts placed on a node that it should run or keep running;
* :func:`mark_running` — a rank's process started (``starting -> running``);
* :func:`launch_failed` — the node could not start it: the attempt ends, the job is requeued
  (or fails after ``max_attempts``);
* :func:`report_end` — a rank ended with an exit code, or without one (lost); when every rank
  of the gang has ended, the job's outcome (all or nothing: the first failed rank of a gang
  asks the others to stop with ``stop_reason="peer-ended"``);
* :func:`process_gone` — the store shows a single-node attempt running on the node, but the
  node has no process and no exit code for it: requeued.

Every function acts only on the (job, attempt, rank) named; :func:`placed_on` is the check
that the rank was placed on the calling node (the node API answers 404 otherwise).
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from broker.service.store.tables import Attempt, Job, utcnow
from broker.service.reconciler import requeue_lost
from broker.states import ON_NODE_STATES, JobState
from broker.service.store.core import JobStore

__all__ = ["node_work", "placed_on", "mark_running", "launch_failed", "report_end", "process_gone"]

log = logging.getLogger("fedbroker.attempts")
S = JobState
_ACTIVE = ON_NODE_STATES


def placed_on(store: JobStore, job_id: str, attempt: int, rank: int, node: str) -> bool:
    """Whether rank ``rank`` of attempt ``attempt`` of ``job_id`` was placed on ``node``
    (read from the attempt's own record, so it stays true after the job moved on)."""
    with store.session() as s:
        a = JobStore.attempt_row(s, job_id, attempt)
        if a is None:
            return False
        return any(p.get("node") == node and p.get("rank") == rank for p in (a.nodes or []))


def node_work(store: JobStore, node: str) -> list[dict]:
    """The ranks placed on ``node`` of every ``starting`` or ``running`` job, less the ranks whose
    end is already recorded. Each: ``job_id``, ``attempt``, ``rank``, ``state``,
    ``cancel_requested``, ``stop_reason``, ``spec`` (the job spec as stored), ``nnodes``,
    ``master_node`` (the first part's node: the rendezvous host) and ``gpus`` (this part's GPU
    indices). One indexed query on ``jobs.state`` (no specs), the placement filter in Python, then
    the specs and attempt records of this node's jobs only."""
    out = []
    with store.session() as s:
        rows = s.execute(select(Job.id, Job.attempt, Job.state, Job.placement, Job.cancel_requested,
                                Job.stop_reason).where(Job.state.in_(_ACTIVE))).all()
        mine = [j for j in rows if (j.placement or {}).get("kind", "onprem") == "onprem"
                and any(p.get("node") == node for p in (j.placement or {}).get("nodes", []))]
        if not mine:
            return out
        ids = [j.id for j in mine]
        specs = dict(s.execute(select(Job.id, Job.spec).where(Job.id.in_(ids))).all())
        ended = {(a.job_id, a.number): dict(a.rank_exits or {}) for a in s.execute(
            select(Attempt.job_id, Attempt.number, Attempt.rank_exits).where(Attempt.job_id.in_(ids))).all()}
        for j in mine:
            parts = j.placement["nodes"]
            done = ended.get((j.id, j.attempt), {})
            for p in parts:
                if p["node"] != node or str(p["rank"]) in done:
                    continue
                out.append({"job_id": j.id, "attempt": j.attempt, "rank": p["rank"], "state": j.state,
                            "cancel_requested": bool(j.cancel_requested), "stop_reason": j.stop_reason,
                            "spec": dict(specs[j.id]), "nnodes": len(parts), "master_node": parts[0]["node"],
                            "gpus": list(p["gpus"])})
    return out


def mark_running(store: JobStore, job_id: str, attempt: int, node: str) -> bool:
    """``starting -> running`` for the job's current attempt ``attempt`` (no-op otherwise); sets the
    job's and the attempt's ``started_at``. Returns whether this call moved it."""
    for _ in range(10):
        with store.session() as s:
            j = s.get(Job, job_id)
            if j is None or j.attempt != attempt or j.state != S.starting.value:
                return False
            now = utcnow()
            if JobStore.cas(s, job_id, j.version, S.starting.value, S.running.value,
                            f"running on {node}", now, started_at=j.started_at or now, state_deadline_at=None):
                a = s.execute(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
                              ).scalar_one_or_none()
                if a is not None and a.started_at is None:
                    a.started_at = now
                return True
    return False


def launch_failed(store: JobStore, job_id: str, attempt: int, node: str, reason: str,
                  max_attempts: int | None) -> bool:
    """The node could not start the attempt: end it (outcome ``launch_failed``) and requeue the job
    (or fail it after ``max_attempts``). No-op unless ``attempt`` is the job's current one and the
    job is ``starting`` or ``running``. Returns whether applied."""
    with store.session() as s:
        j = s.get(Job, job_id)
        if j is not None and j.attempt == attempt and j.state in _ACTIVE:
            return requeue_lost(s, j, utcnow(), f"could not start on {node}: {reason}", "launch_failed",
                                max_attempts=max_attempts)
    return False


def process_gone(store: JobStore, job_id: str, attempt: int, rank: int, node: str,
                 max_attempts: int | None) -> bool:
    """The store shows the attempt running on ``node`` but the node has no process and no exit
    code for rank ``rank``: a single-node job is requeued (or fails after ``max_attempts``); a gang
    is left to its other ranks and the deadlines. Returns whether applied."""
    with store.session() as s:
        j = s.get(Job, job_id)
        if j is None or j.attempt != attempt or j.state != S.running.value:
            return False
        if len((j.placement or {}).get("nodes", [])) != 1:
            return False
        return requeue_lost(s, j, utcnow(), f"process of rank {rank} is gone from {node} without an exit code",
                            max_attempts=max_attempts)


def report_end(store: JobStore, job_id: str, attempt: int, rank: int, node: str, exit_code: int | None,
               max_attempts: int | None) -> tuple[bool, bool]:
    """Record the end of a rank (``exit_code`` ``None``: lost, no exit code) and, when every rank
    has ended, the job's outcome: cancelled (cancel requested), requeued (preempted: without the
    ``max_attempts`` limit; lost: with it), succeeded (every rank 0) or failed. A failed rank of a
    gang whose other ranks still run sets ``stop_reason="peer-ended"`` (all or nothing).

    Returns ``(recorded, changed)``: ``recorded`` is True once the end is recorded (or the attempt
    is no longer the job's), False if the store could not be updated (the node reports it again);
    ``changed`` whether the job left ``running`` (the planner has capacity to reuse)."""
    now = utcnow()
    code = exit_code
    for _ in range(10):
        with store.session() as s:
            j = s.get(Job, job_id)
            att = s.execute(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
                            .with_for_update()).scalar_one_or_none()
            if j is None or att is None:
                return True, False
            exits = dict(att.rank_exits or {})
            exits[str(rank)] = code if code is not None else "lost"
            att.rank_exits = exits
            if j.attempt != attempt or j.state not in _ACTIVE:
                if att.ended_at is None:
                    att.ended_at, att.outcome = now, att.outcome or "stale"
                return True, False
            nranks = len((j.placement or {}).get("nodes", [])) or 1
            if j.state == S.starting.value:  # ended before the node reported it running
                if not JobStore.cas(s, j.id, j.version, S.starting.value, S.running.value,
                                    f"running on {node}", now, started_at=j.started_at or now):
                    continue
                j = s.get(Job, job_id)
                s.refresh(j)
            if att.started_at is None:
                att.started_at = now
            failed = code is None or code != 0
            if len(exits) < nranks:
                if failed and not j.stop_reason and not j.cancel_requested:
                    # all or nothing: stop the other ranks
                    JobStore.bump(s, j.id, j.version, now, stop_reason="peer-ended",
                                  reason=f"rank {rank} on {node} ended ({exits[str(rank)]}); "
                                         "stopping the other ranks")
                return True, False
            att.ended_at = now
            att.exit_code = code
            if j.cancel_requested:
                att.outcome = "cancelled"
                ok = JobStore.cas(s, j.id, j.version, S.running.value, S.cancelled.value,
                                  "cancelled by user; process stopped", now, finished_at=now, exit_code=code)
            elif j.stop_reason == "preempt" or code is None:
                att.outcome = "interrupted"
                why = ("preempted by a higher-priority job" if j.stop_reason == "preempt"
                       else f"process lost on {node}")
                ok = requeue_lost(s, j, now, why, "interrupted",
                                  max_attempts=None if j.stop_reason == "preempt" else max_attempts)
            elif all(v == 0 for v in exits.values()):
                att.outcome = "succeeded"
                ok = JobStore.cas(s, j.id, j.version, S.running.value, S.succeeded.value,
                                  "exit code 0", now, finished_at=now, exit_code=0)
            else:
                att.outcome = "failed"
                bad = {r: c for r, c in exits.items() if c != 0}
                ok = JobStore.cas(s, j.id, j.version, S.running.value, S.failed.value,
                                  f"exit code {code} on {node}" if nranks == 1
                                  else f"ranks ended with {bad}", now, finished_at=now, exit_code=code)
            if ok:
                return True, True
    log.error("could not record the end of %s attempt %d rank %d; the node reports it again", job_id, attempt, rank)
    return False, False
