"""The job lifecycle: states and the one table of allowed transitions.

::

    submitted -> queued -> starting -> running -> succeeded | failed | cancelled
                  |  ^       ^  |        |
                  |  |       |  |        +-> interrupted -> queued   (node lost, preempted)
                  |  +-- deferred          (held for a cheaper/cleaner window, ``not_before``)
                  +-> provisioning -> starting   (cloud: instance being created)

Every change of a job's state goes through :func:`check_transition` and is
applied by the store with compare-and-set on the job's ``version`` column (see
:mod:`broker.service.store.core`); every applied transition is recorded with its time and
reason in the job's state history. Terminal states have no way out.

The table follows the pattern of Ray autoscaler v2's instance manager (one
table of allowed moves, a status history per object).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["JobState", "ALLOWED_TRANSITIONS", "TERMINAL_STATES", "ACTIVE_STATES", "WAITING_STATES",
           "UNFINISHED_STATES", "ON_NODE_STATES", "ACTIVE_STATE_VALUES", "InvalidTransition", "check_transition"]


class JobState(str, Enum):
    """Where a job is in its lifecycle."""

    submitted = "submitted"  # stored by the API, not yet seen by the planner
    queued = "queued"  # waiting for a placement (or for on-prem capacity it was promised)
    deferred = "deferred"  # held until ``not_before`` (off-peak or start window)
    provisioning = "provisioning"  # cloud instance(s) being created
    starting = "starting"  # placed; the node agent has been asked to start it
    running = "running"  # the process/container runs
    interrupted = "interrupted"  # stopped by node loss, preemption or spot interruption; will requeue
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


S = JobState

#: state -> states it may move to. The only source of truth for lifecycle moves.
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.submitted: frozenset({S.queued, S.deferred, S.failed, S.cancelled}),
    S.queued: frozenset({S.deferred, S.provisioning, S.starting, S.failed, S.cancelled}),
    S.deferred: frozenset({S.queued, S.failed, S.cancelled}),
    S.provisioning: frozenset({S.starting, S.queued, S.failed, S.cancelled}),
    S.starting: frozenset({S.running, S.queued, S.failed, S.cancelled}),
    S.running: frozenset({S.succeeded, S.failed, S.cancelled, S.interrupted}),
    S.interrupted: frozenset({S.queued, S.failed, S.cancelled}),
    S.succeeded: frozenset(),
    S.failed: frozenset(),
    S.cancelled: frozenset(),
}

TERMINAL_STATES = frozenset(s for s, nxt in ALLOWED_TRANSITIONS.items() if not nxt)
#: states in which a job holds (or is about to hold) GPUs on a node or an instance
ACTIVE_STATES = frozenset({S.provisioning, S.starting, S.running})
#: :data:`ACTIVE_STATES` as stored (values), for queries
ACTIVE_STATE_VALUES = tuple(sorted(x.value for x in ACTIVE_STATES))
#: states of a job whose ranks an on-prem node agent starts or runs (``GET /v1/node/work``), as values
ON_NODE_STATES = (S.starting.value, S.running.value)
#: states in which a job waits for the planner
WAITING_STATES = frozenset({S.submitted, S.queued, S.deferred, S.interrupted})
#: every state but the terminal ones: what a team's queued-jobs quota counts (``quotas.max_queued_jobs``)
UNFINISHED_STATES = frozenset(JobState) - TERMINAL_STATES


class InvalidTransition(ValueError):
    """A move not in :data:`ALLOWED_TRANSITIONS`; the message names the job and both states."""


def check_transition(job_id: str, from_state: JobState | str, to_state: JobState | str) -> None:
    """Raise :class:`InvalidTransition` unless ``from_state -> to_state`` is allowed."""
    a, b = JobState(from_state), JobState(to_state)
    if b not in ALLOWED_TRANSITIONS[a]:
        allowed = ", ".join(sorted(s.value for s in ALLOWED_TRANSITIONS[a])) or "none (terminal state)"
        raise InvalidTransition(f"job {job_id}: {a.value} -> {b.value} is not allowed (from {a.value}: {allowed})")
