"""The cloud instance lifecycle: states of a ``cloud_instances`` row and the one table of allowed moves.

::

    (none) -> intent -> running -> terminating -> terminated
                |  ^        \\________________/^
                |  |                           |
                |  +-- failed   (the create failed; the same option tried again goes back to intent)
                +-> terminated | terminating | abandoned (no instance id known: the sweep finds it by its tags)

A row is the intent record written *before* the provider's create call (ARCHITECTURE.md §5). Every change of its
state goes through :func:`check_instance_transition` and is recorded, with its time and reason, in the
instance's state history (``cloud_instance_events``; see :mod:`broker.service.store.cloud`). A move to the
same state (a teardown retried, the sweep finding a row already terminated) is no move: it is not checked
and not recorded. ``terminated`` and ``abandoned`` have no way out.

Like :mod:`broker.states` for jobs, after Ray autoscaler v2's instance manager (one table of allowed moves,
a status history per instance).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["InstanceState", "INSTANCE_TRANSITIONS", "LIVE_INSTANCE_STATES", "TERMINAL_INSTANCE_STATES",
           "InvalidInstanceTransition", "check_instance_transition"]


class InstanceState(str, Enum):
    """Where a cloud instance (one rank of one attempt on one option) is in its lifecycle."""

    intent = "intent"  # the row is written; the create call is about to be made (or was, without an answer yet)
    running = "running"  # the provider created it; the attempt's placement names it
    terminating = "terminating"  # a terminate call failed; the reconciler tries again
    terminated = "terminated"  # terminated (or never created: another rank of the gang failed)
    abandoned = "abandoned"  # torn down with no instance id known; the orphan sweep finds it if it exists
    failed = "failed"  # the create call failed with the provider error kept in ``error``


I = InstanceState

#: state -> states it may move to. The only source of truth for instance-state moves.
INSTANCE_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    I.intent: frozenset({I.running, I.failed, I.terminating, I.terminated, I.abandoned}),
    I.running: frozenset({I.terminating, I.terminated}),
    I.terminating: frozenset({I.terminated}),
    I.failed: frozenset({I.intent}),
    I.terminated: frozenset(),
    I.abandoned: frozenset(),
}

#: states whose instance may still exist (the teardown, the retention and ``fedbroker cloud instances`` read them)
LIVE_INSTANCE_STATES = (I.intent.value, I.running.value, I.terminating.value)
TERMINAL_INSTANCE_STATES = frozenset(s for s, nxt in INSTANCE_TRANSITIONS.items() if not nxt)


class InvalidInstanceTransition(ValueError):
    """A move not in :data:`INSTANCE_TRANSITIONS`; the message names the instance row and both states."""


def check_instance_transition(row_id: int | None, from_state: InstanceState | str | None,
                              to_state: InstanceState | str) -> None:
    """Raise :class:`InvalidInstanceTransition` unless ``from_state -> to_state`` is allowed. ``from_state``
    ``None`` is a new row, which must start as ``intent``; a move to the same state is always allowed
    (no move)."""
    b = InstanceState(to_state)
    if from_state is None:
        if b is not I.intent:
            raise InvalidInstanceTransition(f"instance row {row_id}: a new row starts as intent, not {b.value}")
        return
    a = InstanceState(from_state)
    if a is b:
        return
    if b not in INSTANCE_TRANSITIONS[a]:
        allowed = ", ".join(sorted(s.value for s in INSTANCE_TRANSITIONS[a])) or "none (terminal state)"
        raise InvalidInstanceTransition(f"instance row {row_id}: {a.value} -> {b.value} is not allowed "
                                        f"(from {a.value}: {allowed})")
