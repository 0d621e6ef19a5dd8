"""Tests for broker.planner.capacity: best-fit FreeIndex and EASY shadow time."""

from __future__ import annotations

import math

import pytest

from broker.planner.capacity import FreeIndex, shadow_time


def _index(free, types=None, mem=None, healthy=None) -> FreeIndex:
    n = len(free)
    return FreeIndex(free, types or ["V100"] * n, mem or [16.0] * n, healthy)


def test_best_fit_picks_the_fullest_sufficient_node():
    ix = _index([8, 3, 5, 2])
    # 2 GPUs: buckets 2..16, first non-empty is 2 -> node 3 (exactly 2 free)
    assert ix.find("V100", 2, 1) == [3]
    # 3 GPUs: bucket 3 -> node 1; 4 GPUs: bucket 5 -> node 2 (not the empty 8-GPU node 0)
    assert ix.find("V100", 3, 1) == [1]
    assert ix.find("V100", 4, 1) == [2]
    assert ix.find("V100", 6, 1) == [0]
    assert ix.find("V100", 9, 1) is None
    assert ix.max_free("V100") == 8 and ix.max_free("A100") == 0


def test_gangs_take_distinct_nodes_smallest_buckets_first():
    ix = _index([8, 3, 5, 2])
    # 3 nodes x 2 GPUs: buckets 2 (node 3), 3 (node 1), 5 (node 2)
    assert ix.find("V100", 2, 3) == [3, 1, 2]
    assert ix.find("V100", 4, 2) == [2, 0]
    # 8 free GPUs in total on one node cannot hold a 2 x 4 gang (one member per node)
    one = _index([8, 0])
    assert one.find("V100", 4, 2) is None
    assert one.find("V100", 4, 1) == [0]


def test_find_respects_type_memory_exclusion_and_health():
    ix = _index([4, 4, 4, 4], types=["V100", "A100", "A100", "V100"], mem=[16.0, 40.0, 80.0, 32.0],
                healthy=[True, True, True, False])
    assert ix.free.tolist() == [4, 4, 4, 0]  # unhealthy node 3 holds nothing
    assert ix.total_free == {"A100": 8, "V100": 4}
    assert ix.find("A100", 2, 1, min_mem_gb=50.0) == [2]
    assert ix.find("A100", 2, 2) == [1, 2]
    assert ix.find("A100", 2, 2, min_mem_gb=50.0) is None
    assert ix.find("A100", 2, 1, exclude={1}) == [2]
    assert ix.find("V100", 2, 2) is None  # node 3 unhealthy
    assert ix.find("H100", 1, 1) is None


def test_take_and_give_update_buckets():
    ix = _index([8, 3])
    ix.take([0], 3)  # node 0: 8 -> 5
    assert ix.free.tolist() == [5, 3] and ix.total_free["V100"] == 8
    assert ix.find("V100", 4, 1) == [0]
    assert ix.find("V100", 3, 2) == [1, 0]
    ix.take([0, 1], 3)  # 5 -> 2, 3 -> 0
    assert ix.free.tolist() == [2, 0] and ix.total_free["V100"] == 2
    assert ix.find("V100", 3, 1) is None
    ix.give(1, 3)
    assert ix.free.tolist() == [2, 3] and ix.find("V100", 3, 1) == [1]


def test_take_over_allocation_raises():
    ix = _index([8, 3])
    with pytest.raises(ValueError, match=r"node 1: 4 GPUs requested, only 3 free"):
        ix.take([1], 4)
    assert ix.free.tolist() == [8, 3] and ix.total_free["V100"] == 11


def test_take_of_a_gang_is_all_or_nothing():
    """A gang whose second node is short must not leave the first node allocated (gang rule, DESIGN §4-§5)."""
    ix = _index([8, 3])
    with pytest.raises(ValueError):
        ix.take([0, 1], 4)  # node 0 could give 4, node 1 cannot
    assert ix.free.tolist() == [8, 3]
    assert ix.total_free["V100"] == 11
    assert ix.find("V100", 8, 1) == [0]


def test_shadow_time_exact_instant_and_nodes():
    # 3 nodes of 8 V100 with 1, 2, 0 free; a 2 x 4 gang
    ix = _index([1, 2, 0])
    rel = [(100.0, 0, 3), (200.0, 2, 4), (300.0, 1, 6)]
    # t=100: free [4, 2, 0] -> one node with >= 4; t=200: free [4, 2, 4] -> nodes 0 and 2
    assert shadow_time(ix, rel, "V100", 4, 2, 0.0, now_s=10.0) == (200.0, [0, 2])
    # the index itself is not modified
    assert ix.free.tolist() == [1, 2, 0]
    # a 3 x 4 gang needs node 1 too: t=300 -> free [4, 8, 4]
    assert shadow_time(ix, rel, "V100", 4, 3, 0.0, now_s=10.0) == (300.0, [0, 2, 1])


def test_shadow_time_groups_simultaneous_releases_and_prefers_fullest():
    ix = _index([0, 0, 0])
    rel = [(50.0, 0, 4), (50.0, 0, 4)]
    # both releases at t=50 are applied together: node 0 gets 8
    assert shadow_time(ix, rel, "V100", 8, 1, 0.0, now_s=0.0) == (50.0, [0])
    rel2 = [(100.0, 0, 8), (100.0, 1, 5), (100.0, 2, 6)]
    # at t=100 free [8, 5, 6]; best-fit for 4 GPUs: node 1 (5 free) first
    assert shadow_time(ix, rel2, "V100", 4, 1, 0.0, now_s=0.0) == (100.0, [1])
    assert shadow_time(ix, rel2, "V100", 4, 2, 0.0, now_s=0.0) == (100.0, [1, 2])


def test_shadow_time_now_overdue_and_never():
    ix = _index([4, 0], types=["V100", "A100"])
    # fits now -> (now, find())
    assert shadow_time(ix, [], "V100", 2, 1, 0.0, now_s=7.0) == (7.0, [0])
    # an overdue release (expected end 50 < now 100) counts from now
    assert shadow_time(ix, [(50.0, 1, 8)], "A100", 8, 1, 0.0, now_s=100.0) == (100.0, [1])
    # wrong type / too much memory / too big never fit
    t, nodes = shadow_time(ix, [(50.0, 1, 8)], "A100", 8, 2, 0.0, now_s=0.0)
    assert math.isinf(t) and nodes is None
    t, nodes = shadow_time(ix, [(50.0, 1, 8)], "A100", 8, 1, 40.0, now_s=0.0)
    assert math.isinf(t) and nodes is None
