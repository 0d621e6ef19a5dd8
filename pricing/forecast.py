"""Forecasts of hourly carbon intensity and electricity price from the history up to an issue time (issue 13, item 4).

Where a market publishes its own forecast (ENTSO-E day-ahead prices, the GB Carbon Intensity API's 48 h forecast:
:mod:`pricing.price_sources`, :mod:`pricing.carbon_sources`) that is the forecast. Everywhere else, and past the end of
a published one, the planner's 48-72 h horizon is filled by the model here. One public entry point:
:func:`forecast` ``(history, t0, horizon_h) -> CheckedSeries`` flagged ``forecast=True``.

**Information set.** The forecast issued at ``t0`` sees only the hours that ended by ``t0``: hour ``t0h - 1`` and
before, where ``t0h`` is ``t0`` floored to the UTC hour. Its first hour (horizon ``h = 0``) is the hour holding
``t0``. Every lag below reaches back at least ``h + 1`` hours from the hour it forecasts, so no value at or after
``t0h`` can enter (tests/pricing/test_forecast.py checks this with hypothesis). All hours are UTC: no daylight-saving
day of 23 or 25 hours exists on this grid, so "same hour yesterday" is always 24 hours earlier.

**Models** (``y[i]`` = value of hour ``i``; ``NaN`` = missing):

* ``naive_day`` (seasonal naive, period 24): the same hour of the most recent observed day,
  ``D(h) = y[t0h - 24 + (h mod 24)]``; if that hour is missing, the same hour one day earlier, up to
  :data:`NAIVE_LOOKBACK_DAYS` days back.
* ``naive_week`` (seasonal naive, period 168): the same hour of the most recent observed week,
  ``W(h) = y[t0h - 168 + (h mod 168)]``; missing -> one week earlier, up to :data:`NAIVE_LOOKBACK_WEEKS` weeks.
* ``blend`` (the default): the two seasonal profiles blended, plus the recent level's departure from them, decaying
  with the horizon::

      S(h)  = alpha * D(h) + (1 - alpha) * W(h)          (one of D, W missing: the other alone)
      e_j   = y[t0h - j] - (alpha * y[t0h - j - 24] + (1 - alpha) * y[t0h - j - 168]),  j = 1 .. level_h
                                                         (same rule: one lag missing, the other alone)
      a     = mean of the e_j that are not missing        (all missing: a = 0, no level correction)
      F(h)  = S(h) + phi ** (h + 1) * a

  ``alpha`` weighs yesterday against last week, ``a`` is how far the last ``level_h`` hours ran above (or below)
  what the seasonal profile said, and ``phi`` (per hour, 0..1) how fast that departure is expected to fade.
  The parameters (:data:`CARBON_BLEND`, :data:`PRICE_BLEND`) were fitted on 2023 by
  :func:`pricing.forecast_eval.fit_blend` (a grid search minimising, over the bundled zones of each kind, the mean
  of each zone's MAE relative to ``naive_day`` over horizons 0-71 h) and are evaluated on 2024 by
  ``python -m broker.sim.forecast_report``, which also re-runs the fit (docs/FORECASTS.md).

**Missing values** are never forecast as 0: a forecast hour whose every lag is missing stays ``NaN`` (missing,
origin ``""``), and the caller's gap rules (:func:`pricing.hygiene.fill_gaps`) give it the conservative value.

Errors: :class:`ForecastError` (a ``ValueError``) naming the argument and its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pricing.hygiene import CheckedSeries
from pricing.series import HourlySeries, to_epoch_s

__all__ = ["ForecastError", "BlendParams", "MODELS", "CARBON_BLEND", "PRICE_BLEND", "NAIVE_LOOKBACK_DAYS",
           "NAIVE_LOOKBACK_WEEKS", "HOUR_S", "forecast", "forecast_matrix", "blend_parts", "blend_params_for",
           "forecast_origin", "forecast_view", "ForecastedSignals", "SIM_FORECASTS"]

HOUR_S = 3600.0

#: Days the ``naive_day`` profile looks back for an hour that is missing on the most recent day.
NAIVE_LOOKBACK_DAYS = 7
#: Weeks the ``naive_week`` profile looks back for an hour that is missing in the most recent week.
NAIVE_LOOKBACK_WEEKS = 4

#: The models :func:`forecast` knows.
MODELS = ("naive_day", "naive_week", "blend")
#: What a simulated planner can be given (``fedbroker simulate --forecast``): perfect knowledge, or a model.
SIM_FORECASTS = ("perfect",) + MODELS


class ForecastError(ValueError):
    """A forecast could not be made from the arguments given: names the argument and its value."""


@dataclass(frozen=True)
class BlendParams:
    """Parameters of the ``blend`` model (see the module docstring for the formula).

    Attributes:
        alpha: weight of the same hour yesterday against the same hour last week, 0..1.
        phi: per-hour persistence of the recent departure from the seasonal profile, 0..1.
        level_h: hours (>= 1) over which the recent departure is averaged.

    Raises :class:`ForecastError` naming a value out of range.
    """

    alpha: float
    phi: float
    level_h: int

    def __post_init__(self) -> None:
        if not (0.0 <= self.alpha <= 1.0):
            raise ForecastError(f"alpha={self.alpha!r}: must be in [0, 1]")
        if not (0.0 <= self.phi <= 1.0):
            raise ForecastError(f"phi={self.phi!r}: must be in [0, 1]")
        if int(self.level_h) != self.level_h or self.level_h < 1:
            raise ForecastError(f"level_h={self.level_h!r}: must be an integer >= 1")


#: ``blend`` parameters for carbon intensity (gCO2e/kWh), fitted on the bundled 2023 hours of every hourly carbon
#: zone (``python -m broker.sim.forecast_report`` re-runs the fit: fit.json); docs/FORECASTS.md gives the 2024 error.
CARBON_BLEND = BlendParams(alpha=0.6, phi=0.93, level_h=1)
#: ``blend`` parameters for electricity prices (USD/MWh), fitted on the bundled 2023 hours of every price zone.
PRICE_BLEND = BlendParams(alpha=0.6, phi=0.8, level_h=1)


def blend_params_for(unit: str) -> BlendParams:
    """The fitted :class:`BlendParams` for a series in ``unit``: carbon for ``gCO2e/kWh``, price for ``*/MWh``.

    Raises :class:`ForecastError` for any other unit.
    """
    if unit == "gCO2e/kWh":
        return CARBON_BLEND
    if unit.endswith("/MWh"):
        return PRICE_BLEND
    raise ForecastError(f"unit={unit!r}: no fitted forecast parameters (gCO2e/kWh or <currency>/MWh)")


def forecast_origin(model: str) -> str:
    """The origin label of a forecast hour of ``model`` in a :class:`CheckedSeries`, e.g. ``"forecast-blend"``."""
    return f"forecast-{model}"


def _take(y: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``y[idx]`` with ``NaN`` where ``idx`` is outside ``[0, y.size)``."""
    ok = (idx >= 0) & (idx < y.size)
    out = np.full(idx.shape, np.nan)
    out[ok] = y[idx[ok]]
    return out


def _mix(d: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """``alpha * d + (1 - alpha) * w``; where one is missing, the other alone; both missing: ``NaN``."""
    return np.where(np.isnan(d), w, np.where(np.isnan(w), d, alpha * d + (1.0 - alpha) * w))


def _profile(y: np.ndarray, t0: np.ndarray, period: int, lookback: int) -> np.ndarray:
    """Seasonal-naive profile, shape ``(k, period)``: per issue index ``t0[i]`` the hours ``t0 - period + r``,
    each missing one replaced by the same hour ``period`` earlier, up to ``lookback`` periods back."""
    r = np.arange(period)
    out = np.full((t0.size, period), np.nan)
    for k in range(1, lookback + 1):
        v = _take(y, t0[:, None] - k * period + r[None, :])
        out = np.where(np.isnan(out), v, out)
    return out


def forecast_matrix(y: np.ndarray, t0: np.ndarray, horizon_h: int, model: str = "blend",
                    params: BlendParams | None = None) -> np.ndarray:
    """Forecasts of many issue hours at once, shape ``(k, horizon_h)``, in the unit of ``y``.

    Args:
        y: hourly values, shape ``(n,)`` (``NaN`` = missing). Row ``i`` reads only ``y[:t0[i]]``.
        t0: issue hour indexes into ``y``, shape ``(k,)`` (ints; may exceed ``n``: the hours past ``y`` are
            unknown). Row ``i``, column ``h`` forecasts hour ``t0[i] + h``.
        horizon_h: number of hours forecast (>= 1).
        model: one of :data:`MODELS`.
        params: ``blend`` parameters (required for ``blend``; ignored otherwise).

    Returns float64 ``(k, horizon_h)``; ``NaN`` where every lag the model reads is missing.
    Raises :class:`ForecastError` for an unknown model, a horizon < 1, or ``blend`` without parameters.
    """
    if model not in MODELS:
        raise ForecastError(f"model={model!r}: choose from {', '.join(MODELS)}")
    if int(horizon_h) != horizon_h or horizon_h < 1:
        raise ForecastError(f"horizon_h={horizon_h!r}: must be an integer >= 1")
    y = np.asarray(y, dtype=np.float64)
    t0 = np.asarray(t0, dtype=np.int64).reshape(-1)
    h = np.arange(int(horizon_h))
    if model == "naive_day":
        return _profile(y, t0, 24, NAIVE_LOOKBACK_DAYS)[:, h % 24]
    if model == "naive_week":
        return _profile(y, t0, 168, NAIVE_LOOKBACK_WEEKS)[:, h % 168]
    if params is None:
        raise ForecastError("params=None: the blend model needs BlendParams (e.g. blend_params_for(unit))")
    s, level = blend_parts(y, t0, int(horizon_h), params.alpha, int(params.level_h))
    return s + (params.phi ** (h + 1.0))[None, :] * level[:, None]


def blend_parts(y: np.ndarray, t0: np.ndarray, horizon_h: int, alpha: float,
                level_h: int) -> tuple[np.ndarray, np.ndarray]:
    """The two parts of the ``blend`` forecast ``F(h) = S(h) + phi ** (h + 1) * a`` (module docstring).

    Args: as :func:`forecast_matrix`; ``alpha`` and ``level_h`` as in :class:`BlendParams`.

    Returns ``(S, a)``: the blended seasonal profile, shape ``(k, horizon_h)``, and the recent departure ``a``,
    shape ``(k,)`` (0 where every ``e_j`` is missing), both in the unit of ``y``. Split out so that a fit can
    try many ``phi`` on one ``(S, a)``.
    """
    y = np.asarray(y, dtype=np.float64)
    t0 = np.asarray(t0, dtype=np.int64).reshape(-1)
    h = np.arange(int(horizon_h))
    d = _profile(y, t0, 24, NAIVE_LOOKBACK_DAYS)[:, h % 24]
    w = _profile(y, t0, 168, NAIVE_LOOKBACK_WEEKS)[:, h % 168]
    s = _mix(d, w, alpha)
    j = np.arange(1, int(level_h) + 1)
    past = t0[:, None] - j[None, :]
    e = _take(y, past) - _mix(_take(y, past - 24), _take(y, past - 168), alpha)
    have = ~np.isnan(e)
    n_have = have.sum(axis=1)
    level = np.where(n_have > 0, np.where(have, e, 0.0).sum(axis=1) / np.maximum(n_have, 1), 0.0)
    return s, level


def forecast(history: HourlySeries, t0, horizon_h: int, model: str = "blend",
             params: BlendParams | None = None) -> CheckedSeries:
    """Forecast the ``horizon_h`` UTC hours from the one holding ``t0``, from ``history`` before that hour.

    The function the live broker calls where no source publishes a forecast.

    Args:
        history: hourly series (``interval_s == 3600``) of carbon intensity (gCO2e/kWh) or price (<currency>/MWh).
            Only its hours that end by ``floor_hour(t0)`` are read; later hours are ignored (no peeking), and
            hours between its end and ``t0`` count as missing.
        t0: issue time, POSIX seconds (UTC) or an aware datetime.
        horizon_h: hours to forecast (>= 1), e.g. 72 for the planner's horizon.
        model: one of :data:`MODELS` (default ``blend``).
        params: ``blend`` parameters; default :func:`blend_params_for` ``(history.unit)``.

    Returns:
        :class:`CheckedSeries` of ``horizon_h`` hours starting at ``floor_hour(t0)``, same zone and unit,
        ``forecast=True``, every value flagged estimated with origin :func:`forecast_origin` ``(model)``;
        an hour every lag of which is missing is ``NaN`` (origin ``""``), never 0.

    Raises:
        ForecastError: a non-hourly series, history on another hour grid, an unknown model, horizon < 1.
    """
    if history.interval_s != HOUR_S:
        raise ForecastError(f"history.interval_s={history.interval_s}: need an hourly series")
    t0_s = to_epoch_s(t0)
    if not np.isfinite(t0_s):
        raise ForecastError(f"t0={t0!r}: not a finite instant")
    t0h = np.floor(t0_s / HOUR_S) * HOUR_S
    off = (history.start_s / HOUR_S) - np.floor(history.start_s / HOUR_S)
    if off != 0.0:
        raise ForecastError(f"history.start_s={history.start_s}: not on the UTC hour grid")
    if model == "blend" and params is None:
        params = blend_params_for(history.unit)
    i0 = int(round((t0h - history.start_s) / HOUR_S))
    # only the hours before the issue hour are ever handed to the model
    known = history.values[:max(0, min(i0, history.values.size))]
    vals = forecast_matrix(known, np.array([i0]), horizon_h, model, params)[0]
    out = HourlySeries(history.zone, history.unit, float(t0h), vals)
    return CheckedSeries.of(out, forecast_origin(model), estimated=True, forecast=True)


def forecast_view(series: HourlySeries, issue_s: float, model: str = "blend",
                  params: BlendParams | None = None) -> HourlySeries:
    """What a planner knows of ``series`` at ``issue_s``: the measured hours before the issue hour, then the
    forecast issued at ``issue_s`` for every later hour of the series (same grid, zone and unit).

    ``model`` as in :func:`forecast`, or ``"perfect"`` (the series itself: perfect knowledge). Past the
    48-72 h the error is measured for, the same formula continues (the seasonal profiles repeat; the level
    term has faded). An issue hour at or before the series' start gives an all-missing forecast; one after its
    end, the series unchanged. Raises :class:`ForecastError` as :func:`forecast`.
    """
    if model == "perfect":
        return series
    if series.interval_s != HOUR_S:
        raise ForecastError(f"series.interval_s={series.interval_s}: need an hourly series")
    t0h = np.floor(to_epoch_s(issue_s) / HOUR_S) * HOUR_S
    i0 = int(round((t0h - series.start_s) / HOUR_S))
    n = series.values.size
    if i0 >= n:
        return series
    i0 = max(i0, 0)
    if model == "blend" and params is None:
        params = blend_params_for(series.unit)
    vals = np.empty(n)
    vals[:i0] = series.values[:i0]
    vals[i0:] = forecast_matrix(series.values[:i0], np.array([i0]), n - i0, model, params)[0]
    return HourlySeries(series.zone, series.unit, series.start_s, vals, series.interval_s)


class ForecastedSignals:
    """Grid signals as known at one issue time: each series a :func:`forecast_view` of ``signals``' series.

    Args:
        signals: object with ``carbon(zone) -> HourlySeries`` (gCO2e/kWh) and ``price(zone) -> HourlySeries |
            None`` (USD/MWh), e.g. :class:`pricing.signals.GridSignals`: the measured (true) series.
        issue_s: issue time, POSIX seconds (UTC).
        model: one of :data:`MODELS`, or ``"perfect"``.

    The views are built on first use and kept (one per zone and kind). Raises :class:`ForecastError` for an
    unknown model.
    """

    def __init__(self, signals, issue_s: float, model: str = "blend"):
        if model not in SIM_FORECASTS:
            raise ForecastError(f"model={model!r}: choose from {', '.join(SIM_FORECASTS)}")
        self.signals = signals
        self.issue_s = float(issue_s)
        self.model = model
        self._carbon: dict[str, HourlySeries] = {}
        self._price: dict[str, HourlySeries | None] = {}

    def carbon(self, zone: str) -> HourlySeries:
        """Carbon intensity of ``zone`` as known at the issue time, gCO2e/kWh (errors as ``signals.carbon``)."""
        if zone not in self._carbon:
            self._carbon[zone] = forecast_view(self.signals.carbon(zone), self.issue_s, self.model)
        return self._carbon[zone]

    def price(self, zone: str) -> HourlySeries | None:
        """Electricity price of ``zone`` as known at the issue time, USD/MWh; ``None`` if it has no series."""
        if zone not in self._price:
            s = self.signals.price(zone)
            self._price[zone] = None if s is None else forecast_view(s, self.issue_s, self.model)
        return self._price[zone]
