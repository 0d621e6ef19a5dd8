"""Spot availability traces (SkyPilot "Can't Be Late", NSDI'24) and interruption rates.

A :class:`SpotTrace` is one 1-node availability trace: every ``gap_s`` seconds
a probe recorded whether one spot instance of ``accelerator`` could be held in
``zone`` (1) or not (0). Tick ``i`` covers trace time ``[i*gap_s, (i+1)*gap_s)``.
For simulation the trace is **tiled periodically** with period
``len(availability) * gap_s`` and can be shifted by ``offset_s`` (trace time =
``t_s + offset_s``), so any UTC instant maps onto it.

A *drop* (an interruption) is a 1 -> 0 transition: the instant at the start of
a 0 tick whose previous tick (cyclically, so the wrap from the last tick to
the first counts) is 1. ``interruption_rate_per_hour`` = drops per period /
available hours per period.

Bundled data: ``pricing/data/spot_availability_1node.csv.gz`` — the 17
AWS 1-node availability traces (V100 and K80; p3.2xlarge/p3.16xlarge and
p2 instances; campaigns 2022-10-26 and 2023-02-15; ticks of 600 s or 195 s).
See ``pricing/data/SOURCES.md``.

Errors: ``ValueError`` naming the field for a malformed trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pandas as pd

from pricing._data import data_path

__all__ = ["SpotTrace", "load_spot_traces", "pooled_interruption_rate", "SPOT_FILE"]

SPOT_FILE = "spot_availability_1node.csv.gz"


@dataclass(frozen=True, eq=False)
class SpotTrace:
    """One periodic spot-availability trace.

    Attributes:
        zone: provider zone name of the probe, e.g. ``"us-east-1a"``.
        accelerator: accelerator as spelled in the trace, e.g. ``"v100"``.
        campaign: measurement campaign, e.g. ``"aws-02-15-2023"``.
        gap_s: seconds per tick (> 0).
        availability: int8 array ``(n,)`` of 0/1.
        count: GPUs per probed instance (1 for p3.2xlarge, 8 for p3.16xlarge).
    """

    zone: str
    accelerator: str
    campaign: str
    gap_s: float
    availability: np.ndarray
    count: int = 1
    _drops_s: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        a = np.asarray(self.availability)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"availability: need a non-empty 1-D array, got shape {a.shape}")
        if not np.isin(a, (0, 1)).all():
            bad = a[~np.isin(a, (0, 1))][0]
            raise ValueError(f"availability: values must be 0/1, got {bad!r}")
        if not (math.isfinite(self.gap_s) and self.gap_s > 0):
            raise ValueError(f"gap_s={self.gap_s!r}: must be a finite number > 0")
        a = a.astype(np.int8)
        a.setflags(write=False)
        object.__setattr__(self, "availability", a)
        prev = np.roll(a, 1)  # cyclic: tick 0 is preceded by the last tick
        drops = np.flatnonzero((prev == 1) & (a == 0)) * float(self.gap_s)
        drops.setflags(write=False)
        object.__setattr__(self, "_drops_s", drops)

    @property
    def period_s(self) -> float:
        """Length of one tile of the trace, seconds (``len(availability) * gap_s``)."""
        return self.availability.size * float(self.gap_s)

    @property
    def drop_times_s(self) -> np.ndarray:
        """Trace-time instants of the drops within one period, seconds, sorted, shape ``(k,)``."""
        return self._drops_s

    def available_at(self, t_s: float | np.ndarray, offset_s: float = 0.0) -> bool | np.ndarray:
        """Whether the spot instance is available at ``t_s`` (seconds; trace time = ``t_s + offset_s``).

        Vectorised: an array of instants gives a bool array of the same shape.
        """
        p = np.mod(np.asarray(t_s, dtype=np.float64) + offset_s, self.period_s)
        i = np.minimum((p // self.gap_s).astype(np.int64), self.availability.size - 1)
        out = self.availability[i] == 1
        return bool(out) if np.ndim(out) == 0 else out

    def next_drop_after(self, t_s: float | np.ndarray, offset_s: float = 0.0) -> float | np.ndarray:
        """First instant ``>= t_s`` at which availability goes 1 -> 0 (same clock as ``t_s``, seconds).

        The trace is tiled periodically; ``inf`` if it never drops. O(log k)
        per query (binary search over the drop instants), vectorised over arrays.
        """
        scalar = np.ndim(t_s) == 0
        t = np.asarray(t_s, dtype=np.float64)
        d = self._drops_s
        if d.size == 0:
            out = np.full(t.shape, np.inf)
            return float(out) if scalar else out
        period = self.period_s
        p = t + offset_s
        k = np.floor(p / period)
        r = p - k * period
        j = np.searchsorted(d, r, side="left")
        wrap = j >= d.size
        nxt = np.where(wrap, d[0] + period, d[np.minimum(j, d.size - 1)])
        out = k * period + nxt - offset_s
        # guard against float rounding putting the answer just before t
        out = np.where(out < t, out + period, out)
        return float(out) if scalar else out

    @property
    def drops_per_period(self) -> int:
        """Number of 1 -> 0 transitions in one period (cyclic)."""
        return int(self._drops_s.size)

    @property
    def available_hours_per_period(self) -> float:
        """Hours with availability 1 in one period."""
        return float(self.availability.sum()) * float(self.gap_s) / 3600.0

    def interruption_rate_per_hour(self) -> float:
        """Drops per available hour (expected interruptions per instance-hour held).

        ``NaN`` if the trace is never available (the rate is undefined).
        """
        h = self.available_hours_per_period
        return self.drops_per_period / h if h > 0 else float("nan")


def pooled_interruption_rate(traces: list[SpotTrace] | tuple[SpotTrace, ...]) -> float:
    """Total drops / total available hours over ``traces`` (per instance-hour); ``NaN`` if no available hour."""
    h = sum(t.available_hours_per_period for t in traces)
    return sum(t.drops_per_period for t in traces) / h if h > 0 else float("nan")


@lru_cache(maxsize=1)
def _load() -> tuple[SpotTrace, ...]:
    df = pd.read_csv(data_path(SPOT_FILE), dtype={"values": str})
    out = []
    for r in df.itertuples(index=False):
        a = np.frombuffer(r.values.encode("ascii"), dtype=np.uint8) - ord("0")
        out.append(SpotTrace(zone=r.zone, accelerator=r.accelerator, campaign=r.campaign,
                             gap_s=float(r.gap_seconds), availability=a, count=int(r.count)))
    return tuple(out)


def load_spot_traces() -> list[SpotTrace]:
    """All bundled 1-node availability traces (17), as a new list of shared immutable traces."""
    return list(_load())
