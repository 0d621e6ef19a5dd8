"""The job lifecycle table (broker.states): every allowed move, refused moves naming the job and both states,
terminal states without a way out, the derived state sets, and the store's compare-and-set writing history only
for applied moves."""

from __future__ import annotations

import re
from itertools import product

import pytest

from broker.states import (ACTIVE_STATE_VALUES, ACTIVE_STATES, ALLOWED_TRANSITIONS, ON_NODE_STATES, TERMINAL_STATES,
                           UNFINISHED_STATES, WAITING_STATES, InvalidTransition, JobState, check_transition)

#: the moves of the module docstring's diagram, written out (not read from the table)
ALLOWED = {("submitted", "queued"), ("submitted", "deferred"), ("submitted", "failed"), ("submitted", "cancelled"),
           ("queued", "deferred"), ("queued", "provisioning"), ("queued", "starting"), ("queued", "failed"),
           ("queued", "cancelled"),
           ("deferred", "queued"), ("deferred", "failed"), ("deferred", "cancelled"),
           ("provisioning", "starting"), ("provisioning", "queued"), ("provisioning", "failed"),
           ("provisioning", "cancelled"),
           ("starting", "running"), ("starting", "queued"), ("starting", "failed"), ("starting", "cancelled"),
           ("running", "succeeded"), ("running", "failed"), ("running", "cancelled"), ("running", "interrupted"),
           ("interrupted", "queued"), ("interrupted", "failed"), ("interrupted", "cancelled")}
STATES = ["submitted", "queued", "deferred", "provisioning", "starting", "running", "interrupted", "succeeded",
          "failed", "cancelled"]
#: every ordered pair of states (a state to itself included) that is not an allowed move: 10 x 10 - 27 = 73
REFUSED = sorted((a, b) for a, b in product(STATES, STATES) if (a, b) not in ALLOWED)


def test_the_table_is_exactly_the_documented_moves():
    assert [s.value for s in JobState] == STATES
    assert set(ALLOWED_TRANSITIONS) == set(JobState)
    assert {(a.value, b.value) for a, nxt in ALLOWED_TRANSITIONS.items() for b in nxt} == ALLOWED
    assert len(ALLOWED) == 27 and len(REFUSED) == 73


def test_the_derived_sets_hold_the_documented_states():
    assert {s.value for s in TERMINAL_STATES} == {"succeeded", "failed", "cancelled"}
    # holds (or is about to hold) GPUs on a node or an instance
    assert {s.value for s in ACTIVE_STATES} == {"provisioning", "starting", "running"}
    # waits for the planner
    assert {s.value for s in WAITING_STATES} == {"submitted", "queued", "deferred", "interrupted"}
    # every state but the terminal ones: what the queued-jobs quota counts
    assert {s.value for s in UNFINISHED_STATES} == {"submitted", "queued", "deferred", "provisioning", "starting",
                                                    "running", "interrupted"}
    # the ranks an on-prem node agent starts or runs, as the plain values the store's queries use
    assert ON_NODE_STATES == ("starting", "running")
    assert all(type(s) is str for s in ON_NODE_STATES)
    assert ACTIVE_STATE_VALUES == ("provisioning", "running", "starting")


def test_the_sets_split_the_states():
    """A job is waiting, active or finished, never two of them; what it runs on a node is active."""
    assert WAITING_STATES | ACTIVE_STATES | TERMINAL_STATES == set(JobState)
    assert not WAITING_STATES & ACTIVE_STATES and not WAITING_STATES & TERMINAL_STATES
    assert not ACTIVE_STATES & TERMINAL_STATES
    assert UNFINISHED_STATES == WAITING_STATES | ACTIVE_STATES
    assert {JobState(s) for s in ON_NODE_STATES} < ACTIVE_STATES


@pytest.mark.parametrize("a,b", sorted(ALLOWED))
def test_every_allowed_move_passes(a, b):
    check_transition("j-7", a, b)
    check_transition("j-7", JobState(a), JobState(b))  # the enum and its value are the same state


@pytest.mark.parametrize("a,b", REFUSED)
def test_every_other_move_is_refused_naming_the_job_and_both_states(a, b):
    with pytest.raises(InvalidTransition, match=re.escape(f"job j-7: {a} -> {b} is not allowed (from {a}: ")):
        check_transition("j-7", a, b)
    with pytest.raises(InvalidTransition):
        check_transition("j-7", JobState(a), JobState(b))


@pytest.mark.parametrize("terminal", ["succeeded", "failed", "cancelled"])
def test_terminal_states_have_no_way_out(terminal):
    assert ALLOWED_TRANSITIONS[JobState(terminal)] == frozenset()
    for to in STATES:
        with pytest.raises(InvalidTransition,
                           match=re.escape(f"job j-1: {terminal} -> {to} is not allowed "
                                           f"(from {terminal}: none (terminal state))")):
            check_transition("j-1", terminal, to)


def test_refusals_list_what_is_allowed_sorted():
    with pytest.raises(InvalidTransition, match=re.escape("job j-1: running -> queued is not allowed "
                                                          "(from running: cancelled, failed, interrupted, succeeded)")):
        check_transition("j-1", "running", "queued")
    with pytest.raises(InvalidTransition, match=re.escape("job j-1: queued -> queued is not allowed (from queued: "
                                                          "cancelled, deferred, failed, provisioning, starting)")):
        check_transition("j-1", "queued", "queued")  # a move to the same state is refused, not a no-op


def test_an_unknown_state_is_a_value_error_and_a_refusal_is_one_too():
    assert issubclass(InvalidTransition, ValueError)
    with pytest.raises(ValueError, match="exploded"):
        check_transition("j-1", "running", "exploded")
    with pytest.raises(ValueError, match="exploded"):
        check_transition("j-1", "exploded", "running")


def test_every_state_is_reachable_and_every_unfinished_state_can_finish():
    """From ``submitted`` every state can be reached; from every unfinished state each terminal state can."""
    def reachable(start: str) -> set[str]:
        seen, frontier = {start}, [start]
        while frontier:
            a = frontier.pop()
            for b in sorted(to for frm, to in ALLOWED if frm == a and to not in seen):
                seen.add(b)
                frontier.append(b)
        return seen

    assert reachable("submitted") == set(STATES)
    for s in UNFINISHED_STATES:
        assert {"succeeded", "failed", "cancelled"} <= reachable(s.value), s


def test_the_store_records_applied_moves_only(any_store):
    """``JobStore.transition``/``cas`` on a real row: a refused move raises and writes nothing; a stale version
    applies nothing; every applied move bumps the version by one and adds one history row."""
    from broker.model import JobSpec
    from broker.service.store.core import JobStore

    store = any_store
    jid = store.submit("ml", JobSpec(command=["true"]))[0].id
    assert store.get(jid).version == 1
    with pytest.raises(InvalidTransition, match=f"job {jid}: submitted -> running is not allowed"):
        store.transition(jid, "running", "skip the queue")
    assert (store.get(jid).state, store.get(jid).version) == ("submitted", 1)

    assert store.transition(jid, "queued", "accepted")
    with store.session() as s:  # a writer that read version 1 lost the race: nothing applied, nothing recorded
        assert not JobStore.cas(s, jid, 1, "queued", "starting", "stale")
    assert store.transition(jid, "starting", "dispatched", attempt=1)
    assert store.transition(jid, "running", "started")
    assert store.transition(jid, "succeeded", "exit 0", exit_code=0)
    with pytest.raises(InvalidTransition, match=re.escape(f"job {jid}: succeeded -> queued is not allowed "
                                                          "(from succeeded: none (terminal state))")):
        store.transition(jid, "queued", "again")

    assert (store.get(jid).state, store.get(jid).version) == ("succeeded", 5)
    got = [(e.from_state, e.to_state, e.version, e.reason) for e in store.events(jid)]
    assert got == [(None, "submitted", 1, "submitted"), ("submitted", "queued", 2, "accepted"),
                   ("queued", "starting", 3, "dispatched"), ("starting", "running", 4, "started"),
                   ("running", "succeeded", 5, "exit 0")]
