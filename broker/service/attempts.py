"""The attempt lifecycle of on-prem attempts, on the service side (ARCHITECTURE.md §3).

Node agents hold no database credential: they report what their host saw through the node
API (:mod:`broker.service.node_api`), and these functions read the job and its attempt and hand each report
to :mod:`broker.service.lifecycle` (the one home of what an attempt's end means, for every runtime):

* :func:`node_work` — the attempts placed on a node that it should run or keep running;
* :func:`mark_running` — a rank's process started (``starting -> running``);
* :func:`launch_failed` — the node could not start it: the attempt ends, the job is requeued
  (or fails after ``max_attempts``);
* :func:`report_end` — a rank ended with an exit code, or without one (lost):
  :func:`broker.service.lifecycle.rank_ended` (all or nothing: the first failed rank of a gang asks the
  others to stop with ``stop_reason="peer-ended"`` and its exit code is the job's);
* :func:`process_gone` — the store shows a single-node attempt running on the node, but the
  node has no process and no exit code for it: requeued.

Every function acts only on the (job, attempt, rank) named; :func:`placed_on` is the check
that the rank was placed on the calling node (the node API answers 404 otherwise).
"""

from __future__ import annotations

import logging

from broker.service import lifecycle
from broker.service.ledger import snapshot_counters
from broker.service.lifecycle import Place
from broker.service.store import attempts as repo
from broker.service.store.core import JobStore
from broker.service.store.tables import utcnow
from broker.states import ON_NODE_STATES, JobState

__all__ = ["node_work", "placed_on", "mark_running", "launch_failed", "report_end", "process_gone"]

log = logging.getLogger("fedbroker.attempts")
S = JobState
_ACTIVE = ON_NODE_STATES


def placed_on(store: JobStore, job_id: str, attempt: int, rank: int, node: str) -> bool:
    """Whether rank ``rank`` of attempt ``attempt`` of ``job_id`` was placed on ``node``
    (read from the attempt's own record, so it stays true after the job moved on)."""
    with store.session() as s:
        a = repo.attempt_row(s, job_id, attempt)
        if a is None:
            return False
        return any(p.get("node") == node and p.get("rank") == rank for p in (a.nodes or []))


def node_work(store: JobStore, node: str) -> list[dict]:
    """The ranks placed on ``node`` of every ``starting`` or ``running`` job, less the ranks whose
    end is already recorded. Each: ``job_id``, ``attempt``, ``rank``, ``state``,
    ``cancel_requested``, ``stop_reason``, ``spec`` (the job spec as stored), ``nnodes``,
    ``master_node`` (the first part's node: the rendezvous host) and ``gpus`` (this part's GPU
    indices). Read by :func:`broker.service.store.attempts.onprem_work_rows`."""
    out = []
    with store.session() as s:
        mine, specs, ended = repo.onprem_work_rows(s, node, _ACTIVE)
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
            j = repo.job_row(s, job_id)
            if j is None or j.attempt != attempt or j.state != S.starting.value:
                return False
            if lifecycle.mark_running(s, j, repo.attempt_row(s, job_id, attempt), utcnow(), f"running on {node}"):
                return True
    return False


def launch_failed(store: JobStore, job_id: str, attempt: int, node: str, reason: str,
                  max_attempts: int | None) -> bool:
    """The node could not start the attempt: end it (outcome ``launch_failed``) and requeue the job
    (or fail it after ``max_attempts``). No-op unless ``attempt`` is the job's current one and the
    job is ``starting`` or ``running``. Returns whether applied."""
    with store.session() as s:
        j = repo.job_row(s, job_id)
        if j is not None and j.attempt == attempt and j.state in _ACTIVE:
            return lifecycle.requeue_lost(s, j, utcnow(), f"could not start on {node}: {reason}", "launch_failed",
                                          max_attempts=max_attempts)
    return False


def process_gone(store: JobStore, job_id: str, attempt: int, rank: int, node: str,
                 max_attempts: int | None) -> bool:
    """The store shows the attempt running on ``node`` but the node has no process and no exit
    code for rank ``rank``: a single-node job is requeued (or fails after ``max_attempts``); a gang
    is left to its other ranks and the deadlines. Returns whether applied."""
    with store.session() as s:
        j = repo.job_row(s, job_id)
        if j is None or j.attempt != attempt or j.state != S.running.value:
            return False
        if len((j.placement or {}).get("nodes", [])) != 1:
            return False
        return lifecycle.requeue_lost(s, j, utcnow(), f"process of rank {rank} is gone from {node} without an "
                                      "exit code", max_attempts=max_attempts)


def report_end(store: JobStore, job_id: str, attempt: int, rank: int, node: str, exit_code: int | None,
               max_attempts: int | None, stopped_why: str | None = None) -> tuple[bool, bool]:
    """Record the end of a rank (``exit_code`` ``None``: lost, no exit code) and, when every rank
    has ended, the job's outcome (:func:`broker.service.lifecycle.rank_ended`): cancelled (cancel requested),
    requeued (preempted: without the ``max_attempts`` limit; lost: with it), succeeded (every rank 0) or
    failed with the exit code of the rank that failed first. A failed rank of a gang whose other ranks
    still run sets ``stop_reason="peer-ended"`` (all or nothing). A report on an attempt that is no
    longer the job's is recorded and ends that attempt ``stale``. ``stopped_why``: the node stopped the rank
    itself (its wall-clock limit: ``"time limit of 60 s exceeded"``); the job fails with it as its reason.

    Returns ``(recorded, changed)``: ``recorded`` is True once the end is recorded (or the attempt
    is no longer the job's), False if the store could not be updated (the node reports it again);
    ``changed`` whether the job left ``running`` (the planner has capacity to reuse)."""
    now = utcnow()
    place = Place.node(rank, node)
    for _ in range(10):
        with store.session() as s:
            j = repo.job_row(s, job_id)
            att = repo.attempt_row(s, job_id, attempt, lock=True)
            if j is None or att is None:
                return True, False
            if j.attempt != attempt or j.state not in _ACTIVE:
                exits = dict(att.rank_exits or {})
                exits[str(rank)] = exit_code if exit_code is not None else "lost"
                att.rank_exits = exits
                lifecycle.close_attempt(s, att, now, att.outcome or "stale")
                return True, False
            if j.state == S.starting.value:  # ended before the node reported it running
                if not lifecycle.mark_running(s, j, att, now, f"running on {node}"):
                    continue
            elif att.started_at is None:
                att.started_at = now
                snapshot_counters(s, att, now)
            end = lifecycle.rank_ended(s, j, att, rank, exit_code, now, place, max_attempts=max_attempts,
                                       stopped_why=stopped_why)
            if not end.retry:
                return True, end.ended
    log.error("could not record the end of %s attempt %d rank %d; the node reports it again", job_id, attempt, rank)
    return False, False
