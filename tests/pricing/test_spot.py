"""SpotTrace on hand-made traces (wrap-around) and the bundled traces."""

import math

import numpy as np
import pytest

from pricing.spot import SpotTrace, load_spot_traces, pooled_interruption_rate


def trace(vals, gap=10.0):
    return SpotTrace(zone="z", accelerator="v100", campaign="c", gap_s=gap, availability=np.array(vals))


def test_next_drop_after_with_wraparound():
    t = trace([1, 1, 0, 0, 1, 0, 1, 1])  # period 80 s; drops at ticks 2 and 5 -> 20 s, 50 s
    assert t.period_s == 80.0
    np.testing.assert_array_equal(t.drop_times_s, [20.0, 50.0])
    assert t.next_drop_after(0) == 20.0
    assert t.next_drop_after(20) == 20.0  # inclusive
    assert t.next_drop_after(21) == 50.0
    assert t.next_drop_after(51) == 100.0  # wraps into the next tile: 80 + 20
    assert t.next_drop_after(79.5) == 100.0
    assert t.next_drop_after(-5) == 20.0  # previous tile: -80 + ... ; trace time 75 -> next drop 100 - 80
    assert t.next_drop_after(1000) == 1010.0  # 12 tiles = 960; trace time 40 -> next drop at 50
    assert t.next_drop_after(0, offset_s=15) == 5.0  # trace time 15 -> drop at 20 -> t = 5
    np.testing.assert_array_equal(t.next_drop_after(np.array([0.0, 21.0, 51.0])), [20.0, 50.0, 100.0])


def test_drop_across_the_tile_boundary():
    t = trace([0, 1, 1])  # last tick 1, first tick 0: drop at trace time 0 of every tile
    np.testing.assert_array_equal(t.drop_times_s, [0.0])
    assert t.next_drop_after(5) == 30.0
    assert t.next_drop_after(30) == 30.0
    assert t.available_at(5) is False and t.available_at(15) is True and t.available_at(35) is False
    # 1 drop per 20 s of availability = 180 per hour
    assert t.interruption_rate_per_hour() == pytest.approx(180.0)


def test_never_drops():
    assert trace([1, 1, 1]).next_drop_after(7.0) == math.inf
    z = trace([0, 0])
    assert z.next_drop_after(0.0) == math.inf
    assert math.isnan(z.interruption_rate_per_hour())


def test_available_at_vectorised():
    t = trace([1, 1, 0, 0, 1, 0, 1, 1])
    np.testing.assert_array_equal(t.available_at(np.array([0, 19.9, 20, 45, 85]), 0.0), [True, True, False, True, True])


def test_bad_traces():
    with pytest.raises(ValueError, match="availability"):
        trace([0, 2])
    with pytest.raises(ValueError, match="gap_s=0"):
        trace([0, 1], gap=0)
    with pytest.raises(ValueError, match="availability"):
        trace([])


def test_bundled_traces():
    ts = load_spot_traces()
    assert len(ts) == 17
    # availability/1-node/aws-02-15-2023/us-east-1a_v100_1.json: 20,158 ticks of 195 s, mean 0.166683
    t = next(x for x in ts if x.zone == "us-east-1a" and x.campaign == "aws-02-15-2023")
    assert (t.accelerator, t.count, t.gap_s, t.availability.size) == ("v100", 1, 195.0, 20158)
    assert t.availability.mean() == pytest.approx(0.166683, abs=1e-6)
    assert t.interruption_rate_per_hour() == pytest.approx(t.drops_per_period / (t.availability.sum() * 195 / 3600))
    assert 0 < pooled_interruption_rate(ts) < 5
