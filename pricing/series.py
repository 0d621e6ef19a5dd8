"""Time series of hourly grid signals indexed by UTC instants.

A :class:`HourlySeries` holds one value per interval (default 3600 s) starting at
a UTC instant. It is used for electricity prices (USD/MWh) and grid carbon
intensity (gCO2e/kWh). Rules (ARCHITECTURE.md §5):

* every instant is UTC, stored as POSIX seconds (float); local-time data is
  converted on load with :meth:`HourlySeries.from_local`, so 23- and 25-hour
  local days come out as they are;
* a missing value is ``NaN`` and stays missing: any window that touches a
  missing interval integrates to ``NaN`` (never to 0 — a zero carbon hour would
  look like the greenest hour);
* prices may be negative;
* the integral over any window is O(1): a prefix sum over the values plus a
  prefix count of missing intervals, with linear interpolation inside the first
  and last partial interval.

Errors: :class:`SeriesError` (a ``ValueError``) for malformed construction
input, naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Sequence
from zoneinfo import ZoneInfo

import math

import numpy as np

__all__ = ["HourlySeries", "SeriesError", "SeriesStack", "to_epoch_s", "window_integral"]


class SeriesError(ValueError):
    """A time series could not be built: names the offending field and value."""


def to_epoch_s(t: datetime | float | int) -> float:
    """Return POSIX seconds (UTC) for ``t``.

    ``t`` may be a timezone-aware :class:`datetime` or a number of seconds.
    Raises :class:`SeriesError` for a naive datetime (its zone is unknown).
    """
    if isinstance(t, datetime):
        if t.tzinfo is None:
            raise SeriesError(f"time={t.isoformat()!r}: naive datetime; give a UTC-aware one")
        return t.timestamp()
    return float(t)


@dataclass(frozen=True, eq=False)
class HourlySeries:
    """Regular series of ``values[i]`` valid over ``[start_s + i*interval_s, start_s + (i+1)*interval_s)``.

    Attributes:
        zone: grid zone id, e.g. ``"US-CAL-CISO"``.
        unit: unit of one value, e.g. ``"USD/MWh"`` or ``"gCO2e/kWh"``.
        start_s: POSIX seconds (UTC) of the first interval's start.
        values: float64 array, shape ``(n,)``; ``NaN`` marks a missing interval.
        interval_s: interval length in seconds (3600 for hourly).

    Integrals are in ``unit x hours`` (e.g. gCO2e/kWh x h: multiply by a constant
    power in kW to get gCO2e).
    """

    zone: str
    unit: str
    start_s: float
    values: np.ndarray
    interval_s: float = 3600.0
    _cum: np.ndarray = field(init=False, repr=False)
    _cum_missing: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        vals = np.asarray(self.values, dtype=np.float64)
        if vals.ndim != 1 or vals.size == 0:
            raise SeriesError(f"values: need a non-empty 1-D array, got shape {vals.shape}")
        if not np.isfinite(self.start_s):
            raise SeriesError(f"start_s={self.start_s!r}: not a finite instant")
        if not (self.interval_s > 0):
            raise SeriesError(f"interval_s={self.interval_s!r}: must be > 0")
        missing = np.isnan(vals)
        if np.isinf(vals).any():
            raise SeriesError(f"values: infinite value at index {int(np.flatnonzero(np.isinf(vals))[0])}")
        object.__setattr__(self, "values", vals)
        cum = np.zeros(vals.size + 1)
        np.cumsum(np.where(missing, 0.0, vals), out=cum[1:])
        cmiss = np.zeros(vals.size + 1, dtype=np.int64)
        np.cumsum(missing, out=cmiss[1:])
        object.__setattr__(self, "_cum", cum)
        object.__setattr__(self, "_cum_missing", cmiss)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_utc(
        cls,
        times: Sequence[datetime] | np.ndarray,
        values: Sequence[float] | np.ndarray,
        *,
        zone: str,
        unit: str,
        interval_s: float = 3600.0,
    ) -> "HourlySeries":
        """Build from UTC instants (aware datetimes or POSIX seconds) and values.

        Instants need not be contiguous: intervals with no row become ``NaN``
        (missing). Duplicate instants keep their mean. Instants must lie on the
        interval grid of the first one. Raises :class:`SeriesError` otherwise.
        """
        if isinstance(times, np.ndarray) and np.issubdtype(times.dtype, np.datetime64):
            # numpy datetime64 carries no zone: read it as UTC
            t = (times - np.datetime64(0, "s")) / np.timedelta64(1, "s")
            t = np.asarray(t, dtype=np.float64)
        elif not isinstance(times, np.ndarray) or times.dtype == object:
            t = np.array([to_epoch_s(x) for x in times], dtype=np.float64)
        else:
            t = np.asarray(times, dtype=np.float64)
        v = np.asarray(values, dtype=np.float64)
        if t.shape != v.shape:
            raise SeriesError(f"times/values: lengths differ ({t.size} vs {v.size})")
        if t.size == 0:
            raise SeriesError("times: empty series")
        if not np.isfinite(t).all():
            raise SeriesError(f"times: non-finite instant {float(t[~np.isfinite(t)][0])!r}")
        if np.isinf(v).any():
            raise SeriesError(f"values: infinite value {float(v[np.isinf(v)][0])!r}")
        order = np.argsort(t, kind="stable")
        t, v = t[order], v[order]
        start = t[0]
        pos = (t - start) / interval_s
        idx = np.rint(pos).astype(np.int64)
        off = np.abs(pos - idx) > 1e-6
        if off.any():
            bad = datetime.fromtimestamp(t[np.flatnonzero(off)[0]], tz=timezone.utc).isoformat()
            raise SeriesError(f"times: instant {bad} is not on the {interval_s:.0f}-s grid starting at {start}")
        n = int(idx[-1]) + 1
        sums = np.zeros(n)
        counts = np.zeros(n)
        finite = ~np.isnan(v)
        np.add.at(sums, idx[finite], v[finite])
        np.add.at(counts, idx[finite], 1.0)
        out = np.full(n, np.nan)
        have = counts > 0
        out[have] = sums[have] / counts[have]
        return cls(zone=zone, unit=unit, start_s=float(start), values=out, interval_s=interval_s)

    @classmethod
    def from_local(
        cls,
        local_times: Sequence[datetime],
        values: Sequence[float] | np.ndarray,
        *,
        tz: str,
        zone: str,
        unit: str,
        interval_s: float = 3600.0,
    ) -> "HourlySeries":
        """Build from naive local wall-clock times in IANA zone ``tz``.

        Each naive time is localised with ``fold=0`` (the first of two repeated
        hours at a fall-back change; a repeated hour given twice in order gets
        ``fold=1`` the second time). A non-existent spring-forward hour is
        shifted forward by the gap, as :mod:`zoneinfo` does. The result is on
        the UTC grid, so a 23-hour local day has 23 values and a 25-hour day 25.
        """
        z = ZoneInfo(tz)
        out: list[float] = []
        prev: float | None = None
        for lt in local_times:
            if lt.tzinfo is not None:
                raise SeriesError(f"local_times: {lt.isoformat()!r} is aware; give naive local times")
            s = lt.replace(tzinfo=z, fold=0).timestamp()
            if prev is not None and s <= prev:
                s2 = lt.replace(tzinfo=z, fold=1).timestamp()
                if s2 > prev:
                    s = s2
            out.append(s)
            prev = s
        return cls.from_utc(np.asarray(out), values, zone=zone, unit=unit, interval_s=interval_s)

    # ---------------------------------------------------------------- queries
    @property
    def end_s(self) -> float:
        """POSIX seconds (UTC) just after the last interval."""
        return self.start_s + self.values.size * self.interval_s

    def value_at(self, t: datetime | float) -> float:
        """Value of the interval holding instant ``t``; ``NaN`` outside the series or where missing."""
        pos = (to_epoch_s(t) - self.start_s) / self.interval_s
        if not np.isfinite(pos):
            return float("nan")
        i = int(np.floor(pos))
        if i < 0 or i >= self.values.size:
            return float("nan")
        return float(self.values[i])

    def _cum_at(self, pos: np.ndarray) -> np.ndarray:
        """Prefix integral (unit x intervals) at fractional positions ``pos`` (already clipped)."""
        i = np.floor(pos).astype(np.int64)
        i = np.minimum(i, self.values.size - 1)
        frac = pos - i
        v = self.values[i]
        v = np.where(np.isnan(v), 0.0, v)
        return self._cum[i] + frac * v

    def integrals(self, starts: np.ndarray | Sequence[float], duration_s: float | np.ndarray) -> np.ndarray:
        """Vectorised window integrals, in ``unit x hours``.

        Args:
            starts: POSIX seconds (UTC), shape ``(k,)``.
            duration_s: seconds, a scalar or shape ``(k,)``; must be >= 0.

        Returns:
            float64 array ``(k,)``: ``∫ value dt`` over ``[start, start+duration]``
            in unit x hours; ``NaN`` where the window leaves the series or touches
            a missing interval. O(k), independent of the window length.
        """
        s = np.asarray(starts, dtype=np.float64)
        d = np.broadcast_to(np.asarray(duration_s, dtype=np.float64), s.shape)
        if (d < 0).any():
            raise SeriesError(f"duration_s: negative duration {float(d[d < 0][0])}")
        n = self.values.size
        p0 = (s - self.start_s) / self.interval_s
        p1 = (s + d - self.start_s) / self.interval_s
        inside = (p0 >= 0) & (p1 <= n)  # False for NaN starts/durations
        # clip (NaN -> 0 so the index arithmetic below stays in range; masked by ``inside``)
        a = np.clip(np.nan_to_num(p0, nan=0.0), 0, n)
        b = np.clip(np.nan_to_num(p1, nan=0.0), 0, n)
        total = (self._cum_at(b) - self._cum_at(a)) * (self.interval_s / 3600.0)
        # missing intervals touched by [a, b): those with index in [floor(a), ceil(b))
        ia = np.floor(a).astype(np.int64)
        ib = np.minimum(np.ceil(b).astype(np.int64), n)
        ib = np.maximum(ib, np.minimum(ia + 1, n))  # a zero-length window still looks at its interval
        miss = self._cum_missing[ib] - self._cum_missing[np.minimum(ia, n)]
        return np.where(inside & (miss == 0), total, np.nan)

    def integral(self, start: datetime | float, end: datetime | float) -> float:
        """``∫ value dt`` over ``[start, end]`` in unit x hours; ``NaN`` if any part is missing or outside.

        Raises :class:`SeriesError` if ``end < start``.
        """
        s, e = to_epoch_s(start), to_epoch_s(end)
        if e < s:
            raise SeriesError(f"end={e}: before start={s}")
        return float(self.integrals(np.array([s]), e - s)[0])

    def mean(self, start: datetime | float, end: datetime | float) -> float:
        """Time-weighted mean value over ``[start, end]`` (unit); ``NaN`` if missing/outside or empty."""
        s, e = to_epoch_s(start), to_epoch_s(end)
        if e <= s:
            return self.value_at(s)
        return self.integral(s, e) / ((e - s) / 3600.0)

    def times_s(self) -> np.ndarray:
        """Start instants of every interval, POSIX seconds (UTC), shape ``(n,)``."""
        return self.start_s + np.arange(self.values.size) * self.interval_s

    def shifted(self, factor: float = 1.0, offset: float = 0.0, unit: str | None = None) -> "HourlySeries":
        """A new series with ``values * factor + offset`` (missing stays missing)."""
        return HourlySeries(self.zone, unit or self.unit, self.start_s, self.values * factor + offset, self.interval_s)

    def missing_count(self) -> int:
        """Number of missing intervals."""
        return int(self._cum_missing[-1])


def window_integral(series: HourlySeries, start_s: float, duration_s: float) -> float:
    """Scalar fast path of :meth:`HourlySeries.integrals` for one window (unit x hours; NaN if missing/outside).

    Pure-Python arithmetic on the prefix sums: for hot loops that integrate one
    window at a time, where NumPy's per-call overhead would dominate.
    """
    iv = series.interval_s
    n = series.values.size
    p0 = (start_s - series.start_s) / iv
    p1 = (start_s + duration_s - series.start_s) / iv
    if p0 < 0 or p1 > n or duration_s < 0:
        return float("nan")
    i0 = int(p0)
    i1 = int(p1)
    if i1 >= n:
        i1 = n - 1
    cm = series._cum_missing
    j1 = int(math.ceil(p1)) if p1 > p0 else i0 + 1
    if j1 > n:
        j1 = n
    if cm[j1] - cm[i0] != 0:
        return float("nan")
    cum = series._cum
    vals = series.values
    a = cum[i0] + (p0 - i0) * vals[i0] if p0 > i0 else cum[i0]
    b = cum[i1] + (p1 - i1) * vals[i1] if p1 > i1 else cum[i1]
    return float(b - a) * (iv / 3600.0)


class SeriesStack:
    """Several series on one common UTC grid, for window integrals across zones in one NumPy pass.

    Args:
        series: series with the same ``start_s``, ``interval_s`` and length
            (the bundled carbon series all share 2023-01-01..2024-12-31 hourly).

    Raises :class:`SeriesError` if the grids differ.
    """

    def __init__(self, series: Sequence[HourlySeries]):
        if not series:
            raise SeriesError("series: empty stack")
        s0 = series[0]
        for s in series[1:]:
            if s.start_s != s0.start_s or s.interval_s != s0.interval_s or s.values.size != s0.values.size:
                raise SeriesError(f"series: zone {s.zone!r} is not on the grid of zone {s0.zone!r}")
        self.start_s = s0.start_s
        self.interval_s = s0.interval_s
        self.n = s0.values.size
        self.zones = [s.zone for s in series]
        vals = np.stack([s.values for s in series])
        self._vals0 = np.where(np.isnan(vals), 0.0, vals)
        self._cum = np.stack([s._cum for s in series])
        self._cmiss = np.stack([s._cum_missing for s in series])

    def integrals(self, zone_index: np.ndarray, starts: np.ndarray, durations: np.ndarray) -> np.ndarray:
        """``∫ value dt`` (unit x hours) of series ``zone_index[k]`` over ``[starts[k], starts[k]+durations[k]]``.

        All arguments have shape ``(k,)``; NaN where the window leaves the grid or touches a missing value.
        """
        n = self.n
        p0 = (starts - self.start_s) / self.interval_s
        p1 = (starts + durations - self.start_s) / self.interval_s
        inside = (p0 >= 0) & (p1 <= n)
        a = np.clip(p0, 0, n)
        b = np.clip(p1, 0, n)
        ia = np.minimum(a.astype(np.int64), n - 1)
        ib = np.minimum(b.astype(np.int64), n - 1)
        z = zone_index
        ca = self._cum[z, ia] + (a - ia) * self._vals0[z, ia]
        cb = self._cum[z, ib] + (b - ib) * self._vals0[z, ib]
        je = np.maximum(np.minimum(np.ceil(b).astype(np.int64), n), np.minimum(ia + 1, n))
        miss = self._cmiss[z, je] - self._cmiss[z, ia]
        return np.where(inside & (miss == 0), (cb - ca) * (self.interval_s / 3600.0), np.nan)
