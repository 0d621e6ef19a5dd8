"""One definition of each domain constant and rule (issue #10 item 7), pinned by hand-worked numbers, and the
places that use them agree (the store, the trace loaders, the planner, the simulator, the live cycle)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

import broker.model as model
from broker.model import (DEFAULT_CHECKPOINT_INTERVAL_S, DEFAULT_MIN_SLACK_S, FAIR_SHARE_HALF_LIFE_S, WEEK_S, JobSpec,
                          default_slack_s)

T = datetime(2023, 9, 4, tzinfo=timezone.utc)


def test_the_constants_have_their_documented_values():
    assert WEEK_S == 604800.0
    assert FAIR_SHARE_HALF_LIFE_S == 604800.0
    assert DEFAULT_CHECKPOINT_INTERVAL_S == 1800.0
    assert DEFAULT_MIN_SLACK_S == 43200.0


@pytest.mark.parametrize("duration_s, factor, min_slack_s, slack_s", [
    (3600.0, 1.0, 43200.0, 43200.0),     # a 1 h job: the 12 h minimum
    (86400.0, 1.0, 43200.0, 86400.0),    # a 24 h job: one duration
    (43200.0, 1.0, 43200.0, 43200.0),    # the two meet at 12 h
    (86400.0, 0.25, 3600.0, 21600.0),    # a quarter of 24 h beats a 1 h minimum
])
def test_default_slack_is_the_larger_of_factor_times_duration_and_the_minimum(duration_s, factor, min_slack_s, slack_s):
    assert default_slack_s(duration_s, factor, min_slack_s) == slack_s


def test_the_store_and_the_trace_loaders_give_a_job_without_deadline_the_same_deadline():
    from broker.service.store.core import default_deadline
    from broker.sim.traces import default_deadline_s

    for duration_s in (600.0, 43200.0, 100000.0):
        spec = JobSpec(command=["true"], estimated_duration_s=duration_s)
        got = default_deadline(T, spec)
        assert got == T + timedelta(seconds=duration_s + max(duration_s, 43200.0))
        assert default_deadline_s(T.timestamp(), duration_s) == got.timestamp()
    # a spec's own slack wins: 600 s + 60 s
    assert default_deadline(T, JobSpec(command=["true"], estimated_duration_s=600, slack_s=60)) == T + timedelta(seconds=660)


def test_every_default_checkpoint_interval_is_the_one_constant():
    from broker.planner.core import PendingJob, RunningJob
    from broker.service.cycle import FAIR_SHARE_HALF_LIFE_S as cycle_half_life
    from broker.service.lifecycle import checkpointed_work_s
    from broker.sim.simulator import SimulationConfig

    assert JobSpec(command=["true"]).checkpoint_interval_s == 1800.0
    pj = PendingJob(job_id="j", team="t", priority=1, submit_s=0.0, deadline_s=1e6, earliest_s=0.0, work_s=3600.0,
                    gpus_per_node=1, nodes=1)
    rj = RunningJob(job_id="j", pool=0, allocation=[(0, 1)], expected_end_s=1.0, started_s=0.0, priority=1,
                    preemptible=False)
    assert pj.checkpoint_interval_s == rj.checkpoint_interval_s == 1800.0
    # a stored spec without an interval keeps whole 30-min intervals: 5000 s run -> 2 x 1800 s kept
    assert checkpointed_work_s({}, 5000.0) == 3600.0
    assert SimulationConfig().fair_share_half_life_s == cycle_half_life == 604800.0


def test_a_week_of_decay_halves_usage_in_the_live_cycle():
    from broker.planner.fair_share import decayed_usage

    # one GPU for one second that ended exactly one half-life ago weighs ~1/2 GPU-second
    got = decayed_usage([("t", 1, 0.0, 1.0)], now_s=1.0 + WEEK_S)["t"] * 3600.0
    assert math.isclose(got, 0.5, rel_tol=1e-5)


def test_token_lifetimes_count_a_week_as_seven_days():
    from broker.service.tokens import parse_ttl

    assert parse_ttl("2w") == 2 * 604800.0


def test_the_offer_model_lives_in_pricing_and_broker_model_re_exports_it():
    import pricing.offers

    assert model.CloudOffer is pricing.offers.CloudOffer and model.Market is pricing.offers.Market
    assert pricing.offers.MIN_BILLED_S == 60.0


def test_the_job_uid_range_rule_is_one_rule_for_settings_and_agents():
    from broker.service.settings import JobsSettings
    from workers.isolation import check_uid_range

    import broker.job_uids as job_uids

    assert check_uid_range is job_uids.check_uid_range
    assert JobsSettings().uid_range == job_uids.DEFAULT_UID_RANGE == (61184, 65519)
    with pytest.raises(ValueError, match=r"jobs.uid_range=\[100, 114\]: holds 15 ids, at least 16 needed"):
        check_uid_range([100, 114])


def test_wait_text_never_rounds_seconds_to_zero_minutes():
    from broker.model import wait_text

    assert [wait_text(s) for s in (0.0, 40.0, 119.0, 222.0, 7199.0, 18720.0)] == [
        "0 s", "40 s", "119 s", "3.7 min", "120.0 min", "5.2 h"]
