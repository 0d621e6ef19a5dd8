"""Fair share: a team's decayed GPU-hour usage, the second key of the on-prem queue order.

The rule: a GPU-hour used ``age`` seconds before now counts ``2 ** (-age / half_life)`` at now
(half-life :data:`broker.model.FAIR_SHARE_HALF_LIFE_S`, 7 days), times the relative throughput of
its GPU type (V100 = 1.0, :class:`broker.planner.core.GpuTable`): usage is in decayed
reference-GPU-hours. Policies order a priority class by usage / team weight
(:meth:`broker.planner.policy_base.Cycle.queue_key`).

* :func:`decay_rate`, :func:`decay_factor` — the decay;
* :func:`reference_gpu_hours` — GPU-seconds on a GPU type as reference-GPU-hours;
* :func:`decayed_gpu_hours` — the exact decayed integral over GPU intervals (vectorised);
* :func:`decayed_usage` — team -> usage from GPU intervals: the live cycle (attempt rows, GPUs x the
  throughput of the attempt's GPU type);
* :class:`UsageLedger` — usage kept on a clock, decayed as it advances: the simulator.

The two callers differ in *when* GPU-hours are counted, not in the rule's terms: the live cycle
integrates each attempt's interval up to now; the simulator charges a run's planned
reference-GPU-hours at its start (a preempted or interrupted run keeps its whole charge). Charging
as the GPUs are used instead moves the demo's figures (27 of 324 ``results.json`` keys on the
Philly trace; backfill: 56,480 deadline misses instead of 51,880), so the simulator keeps its
charge at start. The two agree as charges get short (``tests/broker/planner/test_fair_share.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import numpy as np

from broker.model import FAIR_SHARE_HALF_LIFE_S

__all__ = ["decay_rate", "decay_factor", "reference_gpu_hours", "decayed_gpu_hours", "decayed_usage", "UsageLedger"]

#: seconds per hour
_H = 3600.0


def decay_rate(half_life_s: float = FAIR_SHARE_HALF_LIFE_S) -> float:
    """The decay constant ``ln 2 / half_life``, per second."""
    return math.log(2) / half_life_s


def decay_factor(elapsed_s: float, half_life_s: float = FAIR_SHARE_HALF_LIFE_S) -> float:
    """What one GPU-hour weighs ``elapsed_s`` seconds later: ``exp(-ln 2 x elapsed / half_life)`` (1 at 0 s,
    1/2 after one half-life)."""
    return math.exp(-decay_rate(half_life_s) * elapsed_s)


def reference_gpu_hours(gpus, run_s, throughput=1.0):
    """``gpus`` GPUs for ``run_s`` seconds on a GPU type of relative ``throughput`` (V100 = 1.0), in
    reference-GPU-hours: ``gpus x run_s / 3600 x throughput`` (floats or arrays that broadcast)."""
    return gpus * run_s / _H * throughput


def decayed_gpu_hours(gpus, start_s, end_s, now_s: float, half_life_s: float = FAIR_SHARE_HALF_LIFE_S) -> np.ndarray:
    """Decayed GPU-hours at ``now_s`` of GPU intervals: the exact integral of the decay weight.

    Args (arrays of one shape ``(n,)``, or scalars that broadcast):
        gpus: GPUs held (reference GPUs: GPU count x relative throughput for reference-GPU-hours).
        start_s, end_s: the interval, POSIX seconds; ``end_s`` NaN = still running (counted up to now).
        now_s: the instant the usage is for, POSIX seconds.
        half_life_s: the decay's half-life, seconds.

    An interval ``[a, b]`` (``b`` capped at now) gives ``gpus x (e^(-r (now - b)) - e^(-r (now - a))) / r / 3600``
    with ``r = ln 2 / half_life``; an interval that has not started by now gives 0. Returns a float array.
    """
    a = np.asarray(start_s, dtype=np.float64)
    b = np.asarray(end_s, dtype=np.float64)
    b = np.where(np.isnan(b), now_s, np.minimum(b, now_s))
    rate = decay_rate(half_life_s)
    weight_s = (np.exp(-rate * (now_s - b)) - np.exp(-rate * (now_s - a))) / rate
    return np.where(b > a, np.asarray(gpus, dtype=np.float64) * weight_s / _H, 0.0)


def decayed_usage(rows: Iterable[tuple[str, float, float, float]], now_s: float,
                  half_life_s: float = FAIR_SHARE_HALF_LIFE_S) -> dict[str, float]:
    """Team -> decayed GPU-hours at ``now_s`` from ``(team, gpus, start_s, end_s)`` rows (``end_s`` NaN or
    None = still running; ``gpus`` in reference GPUs for reference-GPU-hours): :func:`decayed_gpu_hours`
    summed per team. A team none of whose intervals has begun by ``now_s`` is left out."""
    rows = list(rows)
    if not rows:
        return {}
    teams, gpus, start, end = zip(*rows)
    end = [math.nan if e is None else e for e in end]
    hours = decayed_gpu_hours(np.array(gpus, dtype=np.float64), np.array(start, dtype=np.float64),
                              np.array(end, dtype=np.float64), now_s, half_life_s)
    out: dict[str, float] = defaultdict(float)
    for team, h in zip(teams, hours.tolist()):
        if h > 0.0:
            out[team] += h
    return dict(out)


class UsageLedger:
    """Team usage kept on a clock: charges are added at the ledger's time and decay as it advances.

    Args:
        t0_s: the clock's start, POSIX seconds.
        half_life_s: the decay's half-life, seconds.

    ``usage`` (team -> decayed GPU-hours) is the live mapping: hand it to a :class:`Snapshot` as is.
    Advancing by ``dt`` multiplies every team's usage by :func:`decay_factor` ``(dt)``, so after any
    sequence of advances a charge made at ``t`` weighs ``decay_factor(now - t)`` (up to rounding).
    """

    def __init__(self, t0_s: float, half_life_s: float = FAIR_SHARE_HALF_LIFE_S):
        self.usage: dict[str, float] = {}
        self.t_s = t0_s
        self.rate = decay_rate(half_life_s)

    def advance(self, now_s: float) -> None:
        """Decay every team's usage from the ledger's time to ``now_s`` (no-op unless ``now_s`` is later)."""
        if now_s > self.t_s:
            f = math.exp(-self.rate * (now_s - self.t_s))
            usage = self.usage
            for k in usage:
                usage[k] *= f
            self.t_s = now_s

    def charge(self, team: str, gpu_hours: float) -> None:
        """Add ``gpu_hours`` (e.g. :func:`reference_gpu_hours`) to ``team`` at the ledger's time."""
        self.usage[team] = self.usage.get(team, 0.0) + gpu_hours
