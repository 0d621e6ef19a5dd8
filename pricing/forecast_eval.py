"""Forecast error on the bundled history: MAE and MAPE by horizon bucket, and the fit of the blend parameters.

Protocol (docs/FORECASTS.md):

* **Issues**: a forecast is issued at every UTC hour ``t0`` of the evaluation year whose whole horizon
  (``t0 .. t0 + 71 h``) lies in that year; each sees only the hours before ``t0`` (:mod:`pricing.forecast`).
* **Buckets** (:data:`HORIZON_BUCKETS`): horizon hours ``h`` in ``[0, 6)``, ``[6, 24)``, ``[24, 48)``, ``[48, 72)``.
* **MAE**: mean ``|F - y|`` over the (issue, hour) pairs of the bucket where both are known, in the series' unit.
* **MAPE**: mean ``100 |F - y| / |y|`` over the same pairs, leaving out those with ``|y|`` below the floor
  (:data:`MAPE_FLOOR`: 1 gCO2e/kWh; 10 USD/MWh, since near-zero and negative prices make a percentage meaningless);
  the share left out is reported (``mape_left_out``).
* **Fit** (:func:`fit_blend`): grid search of :class:`~pricing.forecast.BlendParams` on 2023 issues every
  :data:`FIT_STRIDE_H` hours (7: coprime with 24 and 168, so every hour of the week is an issue hour), minimising
  the mean over zones of ``MAE(blend) / MAE(naive_day)`` over horizons 0-71 h; the result is evaluated on 2024.

Pure NumPy on the bundled series; no I/O but the bundle's loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable, Sequence

import numpy as np

from pricing.forecast import MODELS, BlendParams, blend_parts, blend_params_for, forecast_matrix
from pricing.series import HourlySeries

__all__ = ["HORIZON_BUCKETS", "HORIZON_H", "MAPE_FLOOR", "FIT_STRIDE_H", "ALPHA_GRID", "PHI_GRID", "LEVEL_GRID",
           "BucketError", "year_issues", "actuals", "bucket_errors", "zone_errors", "FitResult", "fit_blend"]

#: Horizon buckets, hours ``[lo, hi)`` after the issue hour.
HORIZON_BUCKETS: tuple[tuple[int, int], ...] = ((0, 6), (6, 24), (24, 48), (48, 72))
#: Hours forecast per issue: the planner's 72 h horizon.
HORIZON_H = 72
#: Smallest ``|actual|`` counted in MAPE, per kind, in the series' unit (see the module docstring).
MAPE_FLOOR = {"carbon": 1.0, "price": 10.0}
#: Hours between two issue hours of the fit.
FIT_STRIDE_H = 7
#: Grids of the fit.
ALPHA_GRID = tuple(np.round(np.linspace(0.0, 1.0, 11), 2))
PHI_GRID = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 1.0)
LEVEL_GRID = (1, 2, 3, 6, 12, 24)


@dataclass(frozen=True)
class BucketError:
    """Error of one model on one zone in one horizon bucket.

    Attributes:
        lo_h, hi_h: the bucket, hours ``[lo_h, hi_h)``.
        mae: mean absolute error, unit of the series (gCO2e/kWh or USD/MWh); NaN if no pair.
        mape: mean absolute percentage error, %; NaN if no pair passes the floor.
        pairs: (issue, hour) pairs with both values known.
        mape_left_out: share (0..1) of those pairs left out of MAPE (``|actual|`` below the floor).
    """

    lo_h: int
    hi_h: int
    mae: float
    mape: float
    pairs: int
    mape_left_out: float


def year_issues(series: HourlySeries, year: int, horizon_h: int = HORIZON_H, stride_h: int = 1,
                first_offset_h: int = 0) -> np.ndarray:
    """Issue hour indexes into ``series.values``: every ``stride_h`` hours from ``first_offset_h`` hours into
    ``year`` (UTC), whose ``horizon_h`` hours all lie in that year. Shape ``(k,)``, int64 (empty if none)."""
    lo = datetime(year, 1, 1, tzinfo=timezone.utc).timestamp()
    hi = datetime(year + 1, 1, 1, tzinfo=timezone.utc).timestamp()
    i_lo = int(np.ceil((lo - series.start_s) / 3600.0)) + first_offset_h
    i_hi = int(np.floor((hi - series.start_s) / 3600.0)) - horizon_h  # last issue: its horizon ends at hi
    i_lo = max(i_lo, 0)
    i_hi = min(i_hi, series.values.size - horizon_h)
    return np.arange(i_lo, i_hi + 1, stride_h, dtype=np.int64)


def actuals(y: np.ndarray, issues: np.ndarray, horizon_h: int) -> np.ndarray:
    """The measured values the forecasts of ``issues`` aim at: ``y[issues[i] + h]``, shape ``(k, horizon_h)``;
    ``NaN`` past the end of ``y`` or where missing."""
    idx = issues[:, None] + np.arange(horizon_h)[None, :]
    out = np.full(idx.shape, np.nan)
    ok = idx < y.size
    out[ok] = y[idx[ok]]
    return out


def bucket_errors(pred: np.ndarray, actual: np.ndarray, floor: float,
                  buckets: Sequence[tuple[int, int]] = HORIZON_BUCKETS) -> list[BucketError]:
    """MAE and MAPE per horizon bucket of forecasts ``pred`` against ``actual`` (both ``(k, H)``, column = h).

    ``floor``: smallest ``|actual|`` counted in MAPE (unit of the series). Raises ``ValueError`` if shapes differ.
    """
    if pred.shape != actual.shape:
        raise ValueError(f"pred: shape {pred.shape} differs from actual's {actual.shape}")
    out = []
    for lo, hi in buckets:
        p, a = pred[:, lo:hi], actual[:, lo:hi]
        ok = ~np.isnan(p) & ~np.isnan(a)
        err = np.abs(p - a)[ok]
        n = int(ok.sum())
        big = np.abs(a[ok]) >= floor
        mae = float(err.mean()) if n else float("nan")
        mape = float(100.0 * np.mean(err[big] / np.abs(a[ok][big]))) if big.any() else float("nan")
        out.append(BucketError(lo, hi, mae, mape, n, float(1.0 - big.mean()) if n else float("nan")))
    return out


def zone_errors(series: HourlySeries, kind: str, year: int = 2024, models: Iterable[str] = MODELS,
                params: BlendParams | None = None, horizon_h: int = HORIZON_H,
                stride_h: int = 1) -> dict[str, list[BucketError]]:
    """Model -> :class:`BucketError` per bucket for ``series`` forecast at every ``stride_h``-th hour of ``year``.

    ``kind``: ``"carbon"`` or ``"price"`` (picks the MAPE floor). ``params``: blend parameters (default: the
    fitted ones for the series' unit). Raises ``ValueError`` for an unknown kind or a year with no issue hour.
    """
    if kind not in MAPE_FLOOR:
        raise ValueError(f"kind={kind!r}: choose carbon or price")
    issues = year_issues(series, year, horizon_h, stride_h)
    if issues.size == 0:
        raise ValueError(f"year={year}: zone {series.zone!r} has no issue hour with a {horizon_h}-h horizon in it")
    y = series.values
    actual = actuals(y, issues, horizon_h)
    p = params or blend_params_for(series.unit)
    return {m: bucket_errors(forecast_matrix(y, issues, horizon_h, m, p), actual, MAPE_FLOOR[kind])
            for m in models}


@dataclass(frozen=True)
class FitResult:
    """The best blend parameters of a grid search, with its objective.

    Attributes:
        params: the best :class:`BlendParams`.
        relative_mae: mean over zones of ``MAE(blend) / MAE(naive_day)`` (horizons 0..H-1) at ``params``.
        naive_week_relative_mae: the same ratio for ``naive_week`` (for comparison).
        zones: zones fitted on.
    """

    params: BlendParams
    relative_mae: float
    naive_week_relative_mae: float
    zones: tuple[str, ...]


def fit_blend(series: Sequence[HourlySeries], year: int = 2023, horizon_h: int = HORIZON_H,
              stride_h: int = FIT_STRIDE_H, alphas: Sequence[float] = ALPHA_GRID, phis: Sequence[float] = PHI_GRID,
              levels: Sequence[int] = LEVEL_GRID) -> FitResult:
    """Grid-search :class:`BlendParams` on ``year`` (module docstring: objective and issues).

    Raises ``ValueError`` if ``series`` is empty or a series has no issue hour in ``year``.
    """
    if not series:
        raise ValueError("series: nothing to fit on")
    h = np.arange(horizon_h)
    decay = np.array([p ** (h + 1.0) for p in phis])  # (n_phi, H)
    scores = np.zeros((len(alphas), len(levels), len(phis)))
    week_rel = []
    for s in series:
        issues = year_issues(s, year, horizon_h, stride_h, first_offset_h=168)
        if issues.size == 0:
            raise ValueError(f"year={year}: zone {s.zone!r} has no issue hour to fit on")
        y = s.values
        actual = actuals(y, issues, horizon_h)
        base = np.nanmean(np.abs(forecast_matrix(y, issues, horizon_h, "naive_day") - actual))
        week_rel.append(np.nanmean(np.abs(forecast_matrix(y, issues, horizon_h, "naive_week") - actual)) / base)
        for ia, a in enumerate(alphas):
            for il, lv in enumerate(levels):
                sp, level = blend_parts(y, issues, horizon_h, float(a), int(lv))
                for ip in range(len(phis)):
                    f = sp + decay[ip][None, :] * level[:, None]
                    scores[ia, il, ip] += np.nanmean(np.abs(f - actual)) / base
    scores /= len(series)
    ia, il, ip = np.unravel_index(int(np.argmin(scores)), scores.shape)
    best = BlendParams(alpha=float(alphas[ia]), phi=float(phis[ip]), level_h=int(levels[il]))
    return FitResult(best, float(scores[ia, il, ip]), float(np.mean(week_rel)), tuple(s.zone for s in series))
