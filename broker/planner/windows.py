"""The cheapest or cleanest start window for a job of known runtime and power draw.

:func:`best_start` scores every candidate start in one NumPy pass over the
prefix sums of :class:`pricing.series.HourlySeries` (O(1) per candidate, no
Python loop over candidates) and returns the best one as a :class:`WindowChoice`.

Units: instants are POSIX seconds (UTC); power kW; energy kWh; electricity
price USD/MWh; grid carbon intensity gCO2e/kWh; cost USD; emissions kgCO2e.

Missing data stays missing (ARCHITECTURE.md §5): a candidate whose window touches a
missing (or absent) interval of the series it is ranked by is skipped, never
scored as 0 -- a zero-carbon hour would look like the greenest hour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np

from broker.planner.costs import load_emissions_kg, load_energy_kwh, load_tariff_usd
from broker.utc import iso_z
from pricing.series import HourlySeries

__all__ = ["WindowChoice", "best_start", "PREFER", "MAX_CANDIDATES"]

#: accepted values of ``prefer``.
PREFER = ("cheapest", "cleanest")

#: most candidate starts one call may score (guards against a tiny ``slot_s`` over a long range).
MAX_CANDIDATES = 1_000_000


@dataclass(frozen=True)
class WindowChoice:
    """The chosen start window.

    Attributes:
        start_s: chosen start, POSIX seconds (UTC).
        energy_kwh: energy over the run, kWh (``power_kw x runtime_s / 3600``).
        cost_usd: electricity cost of the run started at ``start_s``, USD;
            ``NaN`` if no price series was given or its window has missing data.
        carbon_kg: emissions of the run started at ``start_s``, kgCO2e;
            ``NaN`` if the carbon window has missing data.
        candidates: number of candidate starts considered (including those
            skipped for missing data).
        reason: one line saying why this start was chosen.
    """

    start_s: float
    energy_kwh: float
    cost_usd: float
    carbon_kg: float
    candidates: int
    reason: str


def _finite(name: str, x: float) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={x!r}: not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}={x!r}: must be finite")
    return v


def candidate_starts(earliest_s: float, latest_start_s: float, slot_s: float) -> np.ndarray:
    """Candidate starts, POSIX seconds (UTC), ascending, shape ``(k,)``, ``k >= 1``.

    ``earliest_s`` itself, then every multiple of ``slot_s`` (on the UTC epoch
    grid) strictly after it and at most ``latest_start_s``. Inputs are assumed
    validated (finite, ``latest_start_s >= earliest_s``, ``slot_s > 0``).
    """
    first = (math.floor(earliest_s / slot_s) + 1) * slot_s
    if first <= earliest_s:  # float rounding at huge values
        first += slot_s
    n = math.floor((latest_start_s - first) / slot_s) + 1 if latest_start_s >= first else 0
    if n + 1 > MAX_CANDIDATES:
        raise ValueError(
            f"slot_s={slot_s!r}: {n + 1} candidate starts between earliest_s and latest_start_s "
            f"(at most {MAX_CANDIDATES})"
        )
    grid = first + np.arange(n, dtype=np.float64) * slot_s
    grid = grid[grid <= latest_start_s]  # float rounding of the last step
    return np.concatenate(([earliest_s], grid))


def best_start(
    *,
    earliest_s: float,
    latest_start_s: float,
    runtime_s: float,
    power_kw: float,
    price: HourlySeries | None,
    carbon: HourlySeries,
    prefer: str,
    slot_s: float = 3600.0,
) -> WindowChoice:
    """Pick the start in ``[earliest_s, latest_start_s]`` with the cheapest or cleanest run.

    Candidate starts: ``earliest_s``, then every slot boundary (multiple of
    ``slot_s`` in UTC POSIX seconds) after it up to ``latest_start_s``
    inclusive, clamped to the horizon of the series being ranked: the latest
    start considered is ``min(latest_start_s, series.end_s - runtime_s)`` (but at
    least ``earliest_s``), since a run ending past the series has no data. Any
    far-away ``latest_start_s`` (a deadline in 2199) is therefore accepted; the
    ``reason`` says when the window was clamped. The job draws a constant
    ``power_kw`` for ``runtime_s`` from
    each candidate start; window integrals come from
    :meth:`HourlySeries.integrals` (value x hours, fractional hours interpolated), costed
    with the load formulas of :mod:`broker.planner.costs`.

    * ``prefer="cheapest"`` minimises cost USD
      ``= power_kw x ∫price dt / 1000`` (price USD/MWh, hours); needs ``price``.
    * ``prefer="cleanest"`` minimises kgCO2e ``= power_kw x ∫carbon dt / 1000``
      (carbon gCO2e/kWh, hours).

    Candidates whose window has missing data in the series being minimised
    (price for cheapest, carbon for cleanest) are skipped; the other figure of
    the chosen start is reported as computed (``NaN`` where its own data is
    missing). If every candidate is missing, the result starts at
    ``earliest_s`` and ``reason`` says the data is missing. Ties (within a
    relative 1e-9, to absorb prefix-sum rounding) go to the earliest candidate.

    Args:
        earliest_s: earliest allowed start, POSIX seconds (UTC).
        latest_start_s: latest allowed start, POSIX seconds (UTC), ``>= earliest_s``.
        runtime_s: run length, seconds, ``> 0``.
        power_kw: constant power draw, kW, ``> 0``.
        price: electricity price series, USD/MWh, or ``None`` (then ``cost_usd`` is NaN).
        carbon: grid carbon-intensity series, gCO2e/kWh.
        prefer: ``"cheapest"`` or ``"cleanest"``.
        slot_s: spacing of the candidate grid, seconds, ``> 0`` (default 1 h).

    Returns:
        WindowChoice.

    Raises:
        ValueError: naming the field and value, for a NaN/infinite number,
            ``latest_start_s < earliest_s``, ``runtime_s <= 0``, ``power_kw <= 0``,
            ``slot_s <= 0``, an unknown ``prefer``, ``prefer="cheapest"`` with
            ``price=None``, a ``carbon``/``price`` that is not an HourlySeries,
            or more than :data:`MAX_CANDIDATES` candidate starts.
    """
    earliest = _finite("earliest_s", earliest_s)
    latest = _finite("latest_start_s", latest_start_s)
    runtime = _finite("runtime_s", runtime_s)
    kw = _finite("power_kw", power_kw)
    slot = _finite("slot_s", slot_s)
    if latest < earliest:
        raise ValueError(f"latest_start_s={latest_start_s!r}: before earliest_s={earliest_s!r}")
    if runtime <= 0:
        raise ValueError(f"runtime_s={runtime_s!r}: must be > 0")
    if kw <= 0:
        raise ValueError(f"power_kw={power_kw!r}: must be > 0")
    if slot <= 0:
        raise ValueError(f"slot_s={slot_s!r}: must be > 0")
    if prefer not in PREFER:
        raise ValueError(f"prefer={prefer!r}: must be one of {', '.join(PREFER)}")
    if not isinstance(carbon, HourlySeries):
        raise ValueError(f"carbon={carbon!r}: need an HourlySeries (gCO2e/kWh)")
    if price is not None and not isinstance(price, HourlySeries):
        raise ValueError(f"price={price!r}: need an HourlySeries (USD/MWh) or None")
    if prefer == "cheapest" and price is None:
        raise ValueError("price=None: prefer='cheapest' needs a price series (USD/MWh)")

    # The search ends where the ranked series ends: a start whose run would end after the last
    # interval has no data and would be skipped anyway, so a deadline years away (2199) costs
    # nothing and never exceeds MAX_CANDIDATES; the reason says when the window was clamped.
    ranked = price if prefer == "cheapest" else carbon
    clamp_note = ""
    horizon = ranked.end_s - runtime
    if latest > horizon:
        latest = max(earliest, horizon)
        clamp_note = f"; window clamped to the {'price' if prefer == 'cheapest' else 'carbon'} series' end {iso_z(ranked.end_s)}"
    starts = candidate_starts(earliest, latest, slot)
    k = int(starts.size)
    carbon_kg = load_emissions_kg(kw, carbon.integrals(starts, runtime))
    cost_usd = load_tariff_usd(kw, price.integrals(starts, runtime)) if price is not None else np.full(k, np.nan)
    energy = load_energy_kwh(kw, runtime)
    obj, what, unit = (cost_usd, "price", "USD") if prefer == "cheapest" else (carbon_kg, "carbon", "kgCO2e")

    ok = ~np.isnan(obj)
    n_ok = int(ok.sum())
    if n_ok == 0:
        return WindowChoice(
            start_s=float(earliest),
            energy_kwh=energy,
            cost_usd=float(cost_usd[0]),
            carbon_kg=float(carbon_kg[0]),
            candidates=k,
            reason=(
                f"{what} data missing for all {k} candidate windows; "
                f"starting at earliest_s {iso_z(earliest)}{clamp_note}"
            ),
        )
    best = float(np.min(obj[ok]))
    tol = 1e-9 * max(1.0, float(np.max(np.abs(obj[ok]))))
    i = int(np.flatnonzero(ok & (obj <= best + tol))[0])
    skipped = k - n_ok
    note = f"; {skipped} skipped for missing {what} data" if skipped else ""
    return WindowChoice(
        start_s=float(starts[i]),
        energy_kwh=energy,
        cost_usd=float(cost_usd[i]),
        carbon_kg=float(carbon_kg[i]),
        candidates=k,
        reason=(
            f"{prefer} of {k} candidate starts{note}: {iso_z(float(starts[i]))} "
            f"at {float(obj[i]):.6g} {unit}{clamp_note}"
        ),
    )
