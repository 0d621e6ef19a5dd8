"""Data hygiene for grid signals: completeness, hourly averaging, gap filling, fallbacks.

Every signal the broker reads from a feed or a user's file passes through here
before it becomes an :class:`~pricing.series.HourlySeries`. The rules (issue 13,
item 3):

* **Completeness** is counted against the intervals the window should hold
  (:func:`completeness`): a window of ``h`` hours expects ``h`` values, so an
  empty ``200 OK`` is ``h`` missing values, never "no problem".
* **Sub-hourly data** (5-, 15- or 30-minute) is averaged to UTC hours by
  :func:`to_hourly` *after* sign handling: negative prices are kept as they are
  and enter the mean (clamping to 0 first would raise the hourly mean). An hour
  is only given a value when its sub-intervals cover all 3600 s; a partly
  covered hour is missing — unless the caller sets ``min_coverage`` below 1
  (5-minute feeds: :data:`FIVE_MIN_MIN_COVERAGE`), then an hour covered at least
  that much is the mean of the intervals it has, flagged estimated.
* **Short gaps** (at most ``max_gap_h`` consecutive missing hours with a value
  on both sides, default :data:`MAX_INTERPOLATED_GAP_H`) are filled by linear
  interpolation and flagged estimated (:func:`interpolate_short_gaps`).
* **Long gaps** take the next source's value for that hour, then a
  conservative value (:func:`fill_gaps`), both flagged estimated. For carbon
  the conservative value is never 0 or below (a missing hour must never look
  like the greenest hour): :func:`conservative_value` is the
  :data:`CONSERVATIVE_PERCENTILE`-th percentile of the reference series, else
  :data:`DEFAULT_CONSERVATIVE_CARBON`.
* Prices may be negative and stay negative everywhere.

A :class:`CheckedSeries` carries the values with, per hour, whether the value is
an estimate and which source gave it.

Errors: :class:`pricing.series.SeriesError` (a ``ValueError``) naming the field and value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pricing.series import HourlySeries, SeriesError

__all__ = ["CheckedSeries", "HOUR_S", "MAX_INTERPOLATED_GAP_H", "DEFAULT_CONSERVATIVE_CARBON",
           "CONSERVATIVE_PERCENTILE", "INTERPOLATED", "FIVE_MIN_MIN_COVERAGE",
           "CONSERVATIVE", "hour_grid", "completeness", "to_hourly", "interpolate_short_gaps", "conservative_value",
           "fill_gaps"]

HOUR_S = 3600.0

#: Longest run of missing hours filled by linear interpolation, hours. Two hours keep a missed refresh or a null
#: hour from breaking a window integral, while a longer outage (a day-ahead market not yet published, a feed down)
#: goes to the next source instead of a straight line drawn across a daily cycle.
MAX_INTERPOLATED_GAP_H = 2

#: Carbon intensity used when no source and no reference series has a value, gCO2e/kWh: the IPCC AR5 WGIII
#: (2014) Annex III life-cycle median for pulverised-coal generation, 820 gCO2e/kWh — about the dirtiest grid
#: mix there is, so an hour with no data never looks green.
DEFAULT_CONSERVATIVE_CARBON = 820.0

#: Percentile of a zone's known values used for an hour no source has. High enough that the hour never looks
#: cheap or green (it is above 19 hours in 20), but not the single highest hour: that is often a one-hour
#: scarcity spike (bundled DE-LU prices 2023-24: maximum 1,012 USD/MWh, 95th percentile 171, median 96), and a
#: day filled with it would dominate a replay's bill.
CONSERVATIVE_PERCENTILE = 95.0

#: Share of an hour a 5-minute feed must cover for the hour to get a value (the mean of the points it has,
#: flagged estimated when short of 1): 0.75 = at least 9 of the 12 points. Our choice: one or a few null
#: 5-minute points (a feed's routine hiccup) should not discard the 11 good ones and force an interpolation
#: across whole hours, while an hour missing more than a quarter of its points is too thin to stand for the hour
#: (a marginal rate can step within minutes) and goes to the gap rules instead.
FIVE_MIN_MIN_COVERAGE = 0.75

#: Origin label of an hour filled by interpolation.
INTERPOLATED = "interpolated"
#: Origin label of an hour filled with the conservative value.
CONSERVATIVE = "conservative"


@dataclass(frozen=True, eq=False)
class CheckedSeries:
    """An hourly series with, per interval, an estimated flag and the name of the source of its value.

    Attributes:
        series: the values (unit in ``series.unit``); ``NaN`` where no value could be found.
        estimated: bool array, shape ``(n,)``: True where the value is an estimate (flagged so by the
            source, interpolated, from a fallback source or the conservative value).
        origin: str array, shape ``(n,)``: the source name of each value, :data:`INTERPOLATED`,
            :data:`CONSERVATIVE`, or ``""`` where missing.
        forecast: True if the values are a forecast rather than measured history.
    """

    series: HourlySeries
    estimated: np.ndarray
    origin: np.ndarray
    forecast: bool = False

    def __post_init__(self) -> None:
        n = self.series.values.size
        est = np.asarray(self.estimated, dtype=bool)
        org = np.asarray(self.origin, dtype=object)
        if est.shape != (n,):
            raise SeriesError(f"estimated: shape {est.shape}, expected ({n},)")
        if org.shape != (n,):
            raise SeriesError(f"origin: shape {org.shape}, expected ({n},)")
        object.__setattr__(self, "estimated", est)
        object.__setattr__(self, "origin", org)

    @classmethod
    def of(cls, series: HourlySeries, source: str, estimated: np.ndarray | bool = False,
           forecast: bool = False) -> "CheckedSeries":
        """Wrap ``series`` from ``source``: origin ``source`` where a value exists, ``""`` where missing."""
        have = ~np.isnan(series.values)
        est = np.broadcast_to(np.asarray(estimated, dtype=bool), have.shape) & have
        origin = np.where(have, source, "").astype(object)
        return cls(series, est.copy(), origin, forecast)

    @property
    def missing(self) -> int:
        """Number of hours with no value."""
        return self.series.missing_count()

    def counts(self) -> dict[str, int]:
        """Hours per origin (``""`` counted as ``"missing"``), e.g. ``{"gb-carbon-intensity": 46, "interpolated": 2}``."""
        labels, n = np.unique(np.where(self.origin == "", "missing", self.origin).astype(str), return_counts=True)
        return {str(k): int(v) for k, v in zip(labels, n)}


def hour_grid(start_s: float, end_s: float) -> np.ndarray:
    """UTC hour starts covering ``[start_s, end_s)`` (POSIX s): from ``floor(start)`` to the last hour before ``end``.

    Raises :class:`SeriesError` if the window is empty or not finite.
    """
    if not (np.isfinite(start_s) and np.isfinite(end_s)):
        raise SeriesError(f"window=({start_s!r}, {end_s!r}): not finite")
    if end_s <= start_s:
        raise SeriesError(f"end_s={end_s}: not after start_s={start_s}")
    h0 = np.floor(start_s / HOUR_S) * HOUR_S
    h1 = np.ceil(end_s / HOUR_S) * HOUR_S
    return np.arange(h0, h1, HOUR_S)


def completeness(series: HourlySeries, start_s: float, end_s: float) -> float:
    """Share (0..1) of the UTC hours of ``[start_s, end_s)`` that hold a value in ``series``.

    Hours outside the series count as missing, so a source that answered with no rows scores 0.
    """
    grid = hour_grid(start_s, end_s)
    vals = np.array([series.value_at(t) for t in grid])
    return float(np.count_nonzero(~np.isnan(vals)) / grid.size)


def to_hourly(times_s: Sequence[float] | np.ndarray, values: Sequence[float] | np.ndarray,
              durations_s: float | Sequence[float] | np.ndarray, *, start_s: float, end_s: float, zone: str,
              unit: str, estimated: Sequence[bool] | np.ndarray | None = None,
              source: str = "", min_coverage: float = 1.0) -> CheckedSeries:
    """Average interval data (hourly, 30-, 15- or 5-minute, or a mix) to the UTC hours of ``[start_s, end_s)``.

    Args:
        times_s: interval starts, POSIX seconds (UTC).
        values: one value per interval (``NaN`` = missing); negative values are kept and averaged as they are.
        durations_s: each interval's length in seconds (a scalar for all); each must divide an hour
            (300, 900, 1800, 3600) and each interval must lie inside one UTC hour.
        start_s, end_s: the window, POSIX seconds; the result has one value per UTC hour of it.
        zone, unit: of the result.
        estimated: per interval, True if the source marks the value as an estimate; an hour with any
            estimated part is estimated.
        source: origin label of the hours given a value.
        min_coverage: share of the hour (0 < x <= 1) its valued intervals must cover. 1 (default): the
            whole hour. Below 1, an hour covered at least this much but not wholly is the time-weighted mean
            of the intervals it has, flagged estimated.

    Returns:
        A :class:`CheckedSeries`: an hour's value is the time-weighted mean of its intervals when they
        cover ``min_coverage`` of the hour, else ``NaN``. Intervals outside the window are ignored; a repeated
        interval counts once with the mean of its values (estimated if they differ).

    Raises :class:`SeriesError` for mismatched lengths, a duration that does not divide an hour, an
    interval that straddles an hour boundary, or ``min_coverage`` outside ``(0, 1]``.
    """
    if not 0.0 < min_coverage <= 1.0:
        raise SeriesError(f"min_coverage={min_coverage!r}: must be in (0, 1]")
    t = np.asarray(times_s, dtype=np.float64).ravel()
    v = np.asarray(values, dtype=np.float64).ravel()
    d = np.broadcast_to(np.asarray(durations_s, dtype=np.float64), t.shape).astype(np.float64)
    est = (np.zeros(t.shape, dtype=bool) if estimated is None
           else np.asarray(estimated, dtype=bool).ravel())
    if not (t.shape == v.shape == est.shape):
        raise SeriesError(f"times/values/estimated: lengths differ ({t.size}, {v.size}, {est.size})")
    bad = ~np.isin(d, (300.0, 900.0, 1800.0, 3600.0))
    if bad.any():
        raise SeriesError(f"durations_s: {float(d[bad][0])!r} s does not divide an hour into 5-, 15-, 30- or "
                          "60-min parts")
    grid = hour_grid(start_s, end_s)
    n = grid.size
    sums = np.zeros(n)
    cover = np.zeros(n)
    est_h = np.zeros(n, dtype=bool)
    # a repeated interval (the GB API once served two different records for one half-hour,
    # carbon-intensity/api-definitions#17): the mean of its values, flagged estimated if they differ
    seen: dict[float, list[int]] = {}
    for k in range(t.size):
        if not np.isnan(v[k]):
            seen.setdefault(float(t[k]), []).append(k)
    for ks in seen.values():
        k = ks[0]
        h = int(np.floor((t[k] - grid[0]) / HOUR_S))
        if h < 0 or h >= n:
            continue
        if t[k] + d[k] > grid[h] + HOUR_S + 1e-6 or (t[k] - grid[h]) % d[k] > 1e-6:
            raise SeriesError(f"times_s: interval at {t[k]} of {d[k]:.0f} s is not aligned inside one UTC hour")
        vals = v[ks]
        sums[h] += float(vals.mean()) * d[k]
        cover[h] += d[k]
        est_h[h] |= bool(est[ks].any()) or bool(np.ptp(vals) > 0)
    whole = np.abs(cover - HOUR_S) < 1e-6
    full = whole | ((cover > 0) & (cover >= min_coverage * HOUR_S - 1e-6))
    out = np.full(n, np.nan)
    out[full] = sums[full] / cover[full]
    series = HourlySeries(zone=zone, unit=unit, start_s=float(grid[0]), values=out)
    return CheckedSeries(series, (est_h | ~whole) & full, np.where(full, source, "").astype(object))


def interpolate_short_gaps(checked: CheckedSeries, max_gap_h: int = MAX_INTERPOLATED_GAP_H) -> CheckedSeries:
    """Fill each run of at most ``max_gap_h`` missing hours that has a value on both sides by linear interpolation.

    Filled hours are flagged estimated with origin :data:`INTERPOLATED`. Runs at either end of the series and
    longer runs stay missing (for :func:`fill_gaps`' fallbacks). Raises :class:`SeriesError` if ``max_gap_h < 0``.
    """
    if max_gap_h < 0:
        raise SeriesError(f"max_gap_h={max_gap_h}: must be >= 0")
    v = checked.series.values.copy()
    est = checked.estimated.copy()
    org = checked.origin.copy()
    miss = np.isnan(v)
    n = v.size
    i = 0
    while i < n:
        if not miss[i]:
            i += 1
            continue
        j = i
        while j < n and miss[j]:
            j += 1
        if i > 0 and j < n and j - i <= max_gap_h:
            a, b = v[i - 1], v[j]
            for k in range(i, j):
                v[k] = a + (b - a) * (k - i + 1) / (j - i + 1)
            est[i:j] = True
            org[i:j] = INTERPOLATED
        i = j
    s = checked.series
    return CheckedSeries(HourlySeries(s.zone, s.unit, s.start_s, v, s.interval_s), est, org, checked.forecast)


def conservative_value(kind: str, reference: Sequence[HourlySeries] = ()) -> float | None:
    """The value an hour with no data gets: the :data:`CONSERVATIVE_PERCENTILE`-th percentile (linear
    interpolation) of the known values of the ``reference`` series, pooled.

    ``kind`` is ``"carbon"`` (gCO2e/kWh: never 0 or below; :data:`DEFAULT_CONSERVATIVE_CARBON` when the
    percentile is not positive or there is no reference value) or ``"price"`` (``None`` when there is no
    reference value: no price is safe to invent). Raises :class:`SeriesError` for another ``kind``.
    """
    if kind not in ("carbon", "price"):
        raise SeriesError(f"kind={kind!r}: choose 'carbon' or 'price'")
    known = [r.values[~np.isnan(r.values)] for r in reference]
    pooled = np.concatenate(known) if known else np.zeros(0)
    top = float(np.percentile(pooled, CONSERVATIVE_PERCENTILE)) if pooled.size else None
    if kind == "carbon":
        return top if top is not None and top > 0 else DEFAULT_CONSERVATIVE_CARBON
    return top


def fill_gaps(primary: CheckedSeries, fallbacks: Sequence[CheckedSeries | HourlySeries] = (), *,
              conservative: float | None = None, max_gap_h: int = MAX_INTERPOLATED_GAP_H,
              fallback_names: Sequence[str] | None = None, kind: str | None = None) -> CheckedSeries:
    """Apply the gap rules to ``primary``: interpolate short gaps, then take each fallback in turn, then ``conservative``.

    Args:
        primary: the preferred source's hours (it defines the grid of the result).
        fallbacks: further sources in order of preference; only their values on ``primary``'s hours are used
            (an hour a fallback does not cover stays missing for the next one). Units must equal ``primary``'s.
        conservative: value for hours no source has (``None``: they stay ``NaN``).
        max_gap_h: see :func:`interpolate_short_gaps`.
        fallback_names: origin labels of plain :class:`HourlySeries` fallbacks (default ``fallback1``, ...).
        kind: ``"carbon"`` rejects a ``conservative`` value <= 0.

    Every filled hour is flagged estimated. Raises :class:`SeriesError` for a unit mismatch or a carbon
    conservative value <= 0.
    """
    if kind == "carbon" and conservative is not None and not conservative > 0:
        raise SeriesError(f"conservative={conservative!r}: a carbon intensity stand-in must be > 0 gCO2e/kWh "
                          "(a missing hour must never look like the greenest hour)")
    out = interpolate_short_gaps(primary, max_gap_h)
    s = out.series
    v, est, org = s.values.copy(), out.estimated.copy(), out.origin.copy()
    times = s.times_s() + 0.5 * s.interval_s
    for k, fb in enumerate(fallbacks):
        miss = np.isnan(v)
        if not miss.any():
            break
        fs = fb.series if isinstance(fb, CheckedSeries) else fb
        if fs.unit != s.unit:
            raise SeriesError(f"fallbacks[{k}].unit={fs.unit!r}: differs from the primary's {s.unit!r}")
        got = np.array([fs.value_at(x) for x in times[miss]])
        if isinstance(fb, CheckedSeries):
            idx = np.floor((times[miss] - fs.start_s) / fs.interval_s).astype(np.int64)
            ok = (idx >= 0) & (idx < fs.values.size)
            names = np.where(ok, fb.origin[np.clip(idx, 0, fs.values.size - 1)], "")
        else:
            name = fallback_names[k] if fallback_names and k < len(fallback_names) else f"fallback{k + 1}"
            names = np.full(got.shape, name, dtype=object)
        have = ~np.isnan(got)
        pos = np.flatnonzero(miss)[have]
        v[pos] = got[have]
        est[pos] = True
        org[pos] = names[have]
    if conservative is not None:
        miss = np.isnan(v)
        v[miss] = conservative
        est[miss] = True
        org[miss] = CONSERVATIVE
    return CheckedSeries(HourlySeries(s.zone, s.unit, s.start_s, v, s.interval_s), est, org, primary.forecast)
