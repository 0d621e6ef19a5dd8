"""The cloud instance state table (broker.instance_states): every allowed move, refused moves, and the
store's ``move`` writing history only for applied moves."""

from __future__ import annotations

from itertools import product

import pytest

from broker.instance_states import (INSTANCE_TRANSITIONS, LIVE_INSTANCE_STATES, TERMINAL_INSTANCE_STATES,
                                    InstanceState, InvalidInstanceTransition, check_instance_transition)

I = InstanceState

ALLOWED = {("intent", "running"), ("intent", "failed"), ("intent", "terminating"), ("intent", "terminated"),
           ("intent", "abandoned"), ("running", "terminating"), ("running", "terminated"),
           ("terminating", "terminated"), ("failed", "intent")}


def test_the_table_is_exactly_the_documented_moves():
    assert {(a.value, b.value) for a, nxt in INSTANCE_TRANSITIONS.items() for b in nxt} == ALLOWED
    assert set(INSTANCE_TRANSITIONS) == set(InstanceState)
    assert TERMINAL_INSTANCE_STATES == {I.terminated, I.abandoned}
    assert LIVE_INSTANCE_STATES == ("intent", "running", "terminating")


@pytest.mark.parametrize("a,b", sorted(ALLOWED))
def test_every_allowed_move_passes(a, b):
    check_instance_transition(7, a, b)


@pytest.mark.parametrize("a,b", sorted((a.value, b.value) for a, b in product(InstanceState, InstanceState)
                                       if a is not b and (a.value, b.value) not in ALLOWED))
def test_every_other_move_is_refused_naming_the_row_and_states(a, b):
    with pytest.raises(InvalidInstanceTransition, match=f"instance row 7: {a} -> {b} is not allowed"):
        check_instance_transition(7, a, b)


def test_refusals_say_what_is_allowed_and_new_rows_start_as_intent():
    with pytest.raises(InvalidInstanceTransition, match=r"terminated -> running is not allowed \(from terminated: "
                                                        r"none \(terminal state\)\)"):
        check_instance_transition(1, "terminated", "running")
    with pytest.raises(InvalidInstanceTransition, match=r"running -> intent is not allowed \(from running: "
                                                        r"terminated, terminating\)"):
        check_instance_transition(1, "running", "intent")
    with pytest.raises(InvalidInstanceTransition, match="a new row starts as intent, not running"):
        check_instance_transition(None, None, "running")
    check_instance_transition(None, None, "intent")
    for s in InstanceState:  # a move to the same state is no move
        check_instance_transition(1, s, s)
    with pytest.raises(ValueError):
        check_instance_transition(1, "running", "exploded")


def test_move_records_applied_moves_only(any_store):
    """``store.cloud.move`` on a real row: a refused move writes nothing; a same-state move writes no history."""
    from broker.model import JobSpec
    from broker.service.store import cloud as instances
    from broker.service.store.tables import utcnow
    from providers.base import InstanceRequest, idempotency_token

    jid = any_store.submit("ml", JobSpec(command=["true"]))[0].id
    offer = "aws:us-east-1a:p3.2xlarge:spot"
    req = InstanceRequest(job_id=jid, attempt=1, rank=0, team="ml", offer_id=offer, region="us-east-1", zone="us-east-1a",
                          instance_type="p3.2xlarge", market="spot", gpu_type="V100", gpu_count=1, user_data="",
                          token=idempotency_token(jid, 1, offer, 0), tags={})
    now = utcnow()
    with any_store.session() as s:
        instances.record_intent(s, req, now)
        instances.record_intent(s, req, now)  # idempotent on the token: no second row, no second event
    with any_store.session() as s:
        instances.mark_created(s, jid, 1, 0, offer, "i-1", "10.0.0.5", now)
    with any_store.session() as s:
        [row_id] = [r[0] for r in instances.live_rows(s, jid, 1)]
        with pytest.raises(InvalidInstanceTransition):
            instances.end_teardown(s, row_id, "intent", "back", now, lambda e: False)
    with any_store.session() as s:
        instances.end_teardown(s, row_id, "terminating", "terminate failed", now, lambda e: False)
        instances.end_teardown(s, row_id, "terminating", "terminate failed again", now, lambda e: False)
        instances.end_teardown(s, row_id, "terminated", "the attempt ended", now, lambda e: False)
    with any_store.session() as s:
        got = [(h["from_state"], h["to_state"], h["reason"]) for h in instances.instance_history(s, jid)]
        assert instances.instance_rows(s, 10, live_only=False)[0]["state"] == "terminated"
    assert got == [(None, "intent", f"intent to create on {offer}"), ("intent", "running", "created i-1"),
                   ("running", "terminating", "terminate failed"),
                   ("terminating", "terminated", "the attempt ended")]
