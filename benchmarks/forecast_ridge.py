"""Does a small learned model beat the blend forecast? A per-zone, per-horizon ridge regression (issue 13, item 4).

For each bundled zone and each horizon ``h`` (0..71) a ridge regression of the hour ``t0 + h`` on
``[D(h), W(h), y[t0-1], mean of the 24 h before t0, one-hot hour of day of t0 + h]`` (``D``, ``W``: the seasonal
naive profiles of :mod:`pricing.forecast`; 28 coefficients, no intercept: the hour-of-day dummies carry it), fitted
on every 2023 issue hour (rows with a missing value left out), ``lambda`` = ``--ridge``; evaluated on every 2024
issue hour against the ``blend`` forecast on the same (issue, hour) pairs. Prints, per kind, the mean over zones of
``MAE(ridge) / MAE(blend)`` per horizon bucket and in how many zones the ridge wins at 48-72 h.

    PYTHONPATH=. python3 benchmarks/forecast_ridge.py

NumPy only (normal equations). Result and the decision it led to: docs/FORECASTS.md, "Ridge".
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pricing.carbon import hourly_carbon_zones, load_carbon_intensity
from pricing.electricity import available_price_zones, load_electricity_price
from pricing.forecast import blend_params_for, forecast_matrix
from pricing.forecast_eval import HORIZON_BUCKETS, HORIZON_H, actuals, year_issues
from pricing.series import HourlySeries


def _features(y: np.ndarray, issues: np.ndarray, start_s: float):
    d = forecast_matrix(y, issues, HORIZON_H, "naive_day")
    w = forecast_matrix(y, issues, HORIZON_H, "naive_week")
    last = np.where(issues >= 1, y[np.maximum(issues - 1, 0)], np.nan)
    cum = np.concatenate([[0.0], np.cumsum(np.nan_to_num(y))])
    cnt = np.concatenate([[0], np.cumsum(~np.isnan(y))])
    lo = np.maximum(issues - 24, 0)
    n = cnt[issues] - cnt[lo]
    m24 = np.where(n > 0, (cum[issues] - cum[lo]) / np.maximum(n, 1), np.nan)
    hod0 = np.rint(start_s / 3600.0 + issues).astype(np.int64) % 24
    return d, w, last, m24, hod0


def _design(d, w, last, m24, hod0, h: int) -> np.ndarray:
    k = d.shape[0]
    onehot = np.zeros((k, 24))
    onehot[np.arange(k), (hod0 + h) % 24] = 1.0
    return np.column_stack([d[:, h], w[:, h], last, m24, onehot])


def ridge_vs_blend(series: HourlySeries, ridge: float = 1.0) -> np.ndarray:
    """``[MAE(ridge), MAE(blend)]`` per horizon bucket, shape ``(len(HORIZON_BUCKETS), 2)``, 2024 issues."""
    y = series.values
    tr, te = year_issues(series, 2023, HORIZON_H, 1, first_offset_h=168), year_issues(series, 2024, HORIZON_H, 1)
    ftr, fte = _features(y, tr, series.start_s), _features(y, te, series.start_s)
    atr, ate = actuals(y, tr, HORIZON_H), actuals(y, te, HORIZON_H)
    pred = np.full(ate.shape, np.nan)
    for h in range(HORIZON_H):
        x, t = _design(*ftr, h), atr[:, h]
        ok = np.isfinite(x).all(axis=1) & np.isfinite(t)
        coef = np.linalg.solve(x[ok].T @ x[ok] + ridge * np.eye(x.shape[1]), x[ok].T @ t[ok])
        pred[:, h] = _design(*fte, h) @ coef
    blend = forecast_matrix(y, te, HORIZON_H, "blend", blend_params_for(series.unit))
    out = []
    for lo, hi in HORIZON_BUCKETS:
        a, p, b = ate[:, lo:hi], pred[:, lo:hi], blend[:, lo:hi]
        ok = np.isfinite(a) & np.isfinite(p) & np.isfinite(b)
        out.append((np.abs(p - a)[ok].mean(), np.abs(b - a)[ok].mean()))
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ridge", type=float, default=1.0, help="ridge penalty lambda (sum of squares units)")
    a = ap.parse_args()
    t = time.perf_counter()
    for kind, zones, load in (("carbon", hourly_carbon_zones(), load_carbon_intensity),
                              ("price", available_price_zones(), load_electricity_price)):
        rel = np.array([(lambda r: r[:, 0] / r[:, 1])(ridge_vs_blend(load(z), a.ridge)) for z in zones])
        buckets = ", ".join(f"{lo}-{hi} h {v:.3f}" for (lo, hi), v in zip(HORIZON_BUCKETS, rel.mean(axis=0)))
        print(f"{kind} ({len(zones)} zones): MAE(ridge) / MAE(blend), mean of zones: {buckets}; ridge better at "
              f"48-72 h in {int((rel[:, -1] < 1).sum())} zones ({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
