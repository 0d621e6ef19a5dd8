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
* :class:`UsageLedger` — usage kept on a clock, decayed as it advances: the simulator;
* :func:`fair_share_factors`, :func:`age_factor`, :func:`multifactor_priority` — the on-prem queue's
  priority within a class: fair share weighed against age (below).

Multifactor priority (Slurm's ``priority/multifactor`` with ``PriorityWeightAge``/``PriorityMaxAge``
and the classic fair-share factor). Within one priority class a waiting job's priority is::

    P = weight_age x min(age / max_age, 1) + 2 ** (-(u_t / w_t) / (sum_u / sum_w))

``age = now - submit`` (s); ``max_age`` = ``PlannerConfig.priority_max_age_s``, ``weight_age`` =
``PlannerConfig.priority_weight_age``; ``u_t`` the team's decayed usage (reference-GPU-hours),
``w_t`` its weight, the sums over the teams with usage or a configured weight. The second term, the
fair-share factor F, is 1 for a team without usage, 1/2 for a team at the mean usage per weight and
tends to 0 for heavy teams: F is in (0, 1]. Higher P goes first, then submission time, then job id.

The bound. Since F differences are below 1, job J precedes job K of its class whenever
``weight_age x (min(a_J / max_age, 1) - min(a_K / max_age, 1)) >= 1`` whatever the teams' usage:
with neither at the cap, whenever K was submitted at least ``max_age / weight_age`` after J. (With the
defaults, 1 h and 2: half an hour; exactly, ``(F_K - F_J) x max_age / weight_age``.) So a stream of
another team's jobs can pass J only during its first ``max_age / weight_age`` of waiting, unless
its jobs themselves wait ``max_age x (1 - 1 / weight_age)``; J is then the top of the queue, holds
the EASY reservation, and starts at its shadow time (the expected end of the running jobs it waits
for; :func:`broker.planner.policy_base.run_onprem_queue`). ``weight_age = 0`` gives the strict
order of before: fair share, then age.

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
from typing import Iterable, Mapping

import numpy as np

from broker.model import FAIR_SHARE_HALF_LIFE_S

__all__ = ["decay_rate", "decay_factor", "reference_gpu_hours", "decayed_gpu_hours", "decayed_usage", "UsageLedger",
           "fair_share_factors", "age_factor", "multifactor_priority"]

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


def fair_share_factors(usage: Mapping[str, float], weights: Mapping[str, float]) -> tuple[dict[str, float], float]:
    """The fair-share factor ``F = 2 ** (-(u_t / w_t) / (sum_u / sum_w))`` of each team (Slurm's classic
    factor: normalised usage over normalised shares), in (0, 1].

    Args:
        usage: team -> decayed reference-GPU-hours (``Snapshot.team_usage``).
        weights: team -> fair-share weight (``PlannerConfig.team_weight``; absent = 1).

    The sums run over the teams in ``usage`` or ``weights``. Returns ``(factors, default)``: team -> F for
    those teams, and the factor of any other team (no usage: 1.0). With no usage at all every F is 1.
    Raises ValueError for a negative usage or a weight that is not positive (names the team).
    """
    teams = set(usage) | set(weights)
    for t in teams:
        u, w = usage.get(t, 0.0), weights.get(t, 1.0)
        if not u >= 0.0:
            raise ValueError(f"team_usage[{t!r}]={u!r}: decayed GPU-hours must be >= 0")
        if not w > 0.0:
            raise ValueError(f"team_weight[{t!r}]={w!r}: a fair-share weight must be > 0")
    sum_u = sum(usage.get(t, 0.0) for t in teams)
    sum_w = sum(weights.get(t, 1.0) for t in teams)
    if sum_u <= 0.0:
        return {t: 1.0 for t in teams}, 1.0
    mean = sum_u / sum_w  # decayed GPU-hours per unit of weight
    return {t: 2.0 ** (-(usage.get(t, 0.0) / weights.get(t, 1.0)) / mean) for t in teams}, 1.0


def age_factor(age_s: float, max_age_s: float) -> float:
    """``min(age / max_age, 1)``: 0 at submission, growing linearly to 1 at ``max_age_s`` seconds (Slurm's
    ``PriorityMaxAge``); a negative age (clock skew) counts as 0."""
    return min(max(age_s, 0.0) / max_age_s, 1.0)


def multifactor_priority(age_s: float, fair_factor: float, max_age_s: float, weight_age: float) -> float:
    """A waiting job's priority within its class: ``weight_age x age_factor(age_s, max_age_s) + fair_factor``
    (module docstring; dimensionless, higher first)."""
    return weight_age * age_factor(age_s, max_age_s) + fair_factor
