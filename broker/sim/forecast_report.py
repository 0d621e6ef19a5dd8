"""Forecast error and planner regret on the bundled history: the report of docs/FORECASTS.md (issue 13, item 4).

``python -m broker.sim.forecast_report --out out/forecast/`` writes:

* ``forecast_error.csv``: per kind (carbon, price), zone, model and horizon bucket, MAE (unit of the series),
  MAPE (%), pairs and the share left out of MAPE (:mod:`pricing.forecast_eval`), forecasts issued every hour of
  2024 (the parameters were fitted on 2023);
* ``fit.json``: the 2023 grid fit of the blend parameters (:func:`pricing.forecast_eval.fit_blend`) next to the
  constants :data:`pricing.forecast.CARBON_BLEND` / :data:`~pricing.forecast.PRICE_BLEND` in use (``--no-fit``
  skips it: ~1.5 min on one core);
* ``regret.csv``: the planner's regret, ``(cost, carbon)`` of a run that plans on forecasts minus the run with
  perfect knowledge, same trace and seed (``fedbroker simulate --forecast``), for the ``federated`` policy on a
  short window of the Philly trace in 2024 (out of the fit's sample): (a) ``onprem``: the bundled pool moved to
  each zone with a price series, no cloud, so every decision is when to run on that grid; (b) ``hybrid``: the
  bundled scenario (Toronto pool + every cloud offer);
* ``FORECASTS.md``: both as Markdown tables (docs/FORECASTS.md holds a copy with the machine and commit).

Runs in a few minutes on 2 cores (``--workers``). No network.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import platform
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

__all__ = ["RegretRow", "regret_rows", "error_rows", "markdown", "main"]

#: Forecast modes of the regret runs; ``perfect`` is the reference.
REGRET_MODES = ("perfect", "naive_day", "naive_week", "blend")
#: Default window of the regret runs: the Philly trace's first jobs, shifted to start on this Monday of 2024.
DEFAULT_START = "2024-09-02"
DEFAULT_JOBS = 1000
#: Simulator step of the regret runs, seconds (as ``make demo``: one planner cycle a minute at most).
STEP_S = 60.0


@dataclass(frozen=True)
class RegretRow:
    """One regret run.

    Attributes:
        scenario: ``onprem`` (the pool moved to ``zone``, no cloud) or ``hybrid`` (bundled pool + cloud).
        zone: the pool's carbon and price zone.
        model: forecast mode (``perfect`` is the reference).
        cost_usd, carbon_kg: the run's cost (cloud + on-prem electricity, USD) and carbon (kgCO2e), measured series.
        regret_usd, regret_kg: minus the ``perfect`` run of the same scenario and zone (0 for ``perfect``).
        deferred_jobs: jobs the planner deferred at least once.
        wall_s: wall-clock seconds of the run.
    """

    scenario: str
    zone: str
    model: str
    cost_usd: float
    carbon_kg: float
    regret_usd: float
    regret_kg: float
    deferred_jobs: int
    wall_s: float


_W: dict[str, Any] = {}  # per worker process: scenario and trace


def _load(jobs: int, start: str) -> None:
    if _W.get("key") == (jobs, start):
        return
    from broker.sim.scenario import load_scenario
    from broker.sim.traces import load_philly

    scen = load_scenario()
    t0 = datetime.fromisoformat(start).replace(tzinfo=timezone.utc)
    tr = load_philly(site_tz=scen.pools[0].timezone, start=t0, limit=jobs)
    _W.update(key=(jobs, start), scen=scen, trace=tr)


def _run(task: tuple[str, str, str, int, str, int]) -> tuple[str, str, str, dict, float]:
    """One run: ``(scenario, zone, model, jobs, start, seed)`` -> ``(scenario, zone, model, metrics, wall_s)``."""
    from broker.planner.core import PlannerConfig
    from broker.sim.simulator import SimulationConfig, simulate
    from pricing.signals import load_grid_signals

    scenario, zone, model, jobs, start, seed = task
    _load(jobs, start)
    scen, tr = _W["scen"], _W["trace"]
    cfg = SimulationConfig(tick_s=STEP_S, seed=seed, forecast=model, usage_records=False)
    t = time.perf_counter()
    if scenario == "onprem":
        pools = [p.model_copy(update={"carbon_zone": zone, "price_zone": zone}) for p in scen.pools]
        r = simulate(tr, pools, [], load_grid_signals([zone]), "federated", gpus=scen.gpus,
                     planner_config=PlannerConfig(cloud_enabled=False), config=cfg)
    else:
        r = simulate(tr, scen.pools, scen.offers, scen.signals, "federated", gpus=scen.gpus,
                     spot_traces=scen.spot_traces, config=cfg)
    return scenario, zone, model, dict(r.metrics), time.perf_counter() - t


def regret_rows(zones: Sequence[str], jobs: int = DEFAULT_JOBS, start: str = DEFAULT_START, seed: int = 0,
                workers: int = 2, hybrid: bool = True) -> list[RegretRow]:
    """Run every (scenario, zone, mode) of the module docstring in ``workers`` processes; rows in task order.

    ``zones``: pool zones of the ``onprem`` scenario (each needs carbon and price series). Raises ``ValueError``
    for a zone without them (from the loaders) and ``RuntimeError`` if a run fails.
    """
    from broker.sim.scenario import load_scenario

    tasks = [("onprem", z, m, jobs, start, seed) for z in zones for m in REGRET_MODES]
    if hybrid:
        home = load_scenario().pools[0].carbon_zone
        tasks += [("hybrid", home, m, jobs, start, seed) for m in REGRET_MODES]
    if workers <= 1:
        got = [_run(t) for t in tasks]
    else:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            got = list(ex.map(_run, tasks))
    ref = {(s, z): m for s, z, mode, m, _ in got if mode == "perfect"}
    rows = []
    for s, z, mode, m, wall in got:
        p = ref[(s, z)]
        rows.append(RegretRow(s, z, mode, float(m["cost_usd"]), float(m["carbon_kg"]),
                              float(m["cost_usd"] - p["cost_usd"]), float(m["carbon_kg"] - p["carbon_kg"]),
                              int(m["deferred_jobs"]), round(wall, 2)))
    return rows


def error_rows() -> list[dict]:
    """Forecast error of every model on every bundled hourly carbon zone and price zone, 2024, by bucket.

    One dict per (kind, zone, model, bucket) with the :class:`pricing.forecast_eval.BucketError` fields and
    ``estimated`` (the zone's carbon figure is partly our estimate: :func:`pricing.carbon.carbon_estimated`).
    """
    from pricing.carbon import carbon_estimated, hourly_carbon_zones, load_carbon_intensity
    from pricing.electricity import available_price_zones, load_electricity_price
    from pricing.forecast_eval import zone_errors

    out = []
    for kind, zones, load in (("carbon", hourly_carbon_zones(), load_carbon_intensity),
                              ("price", available_price_zones(), load_electricity_price)):
        for z in zones:
            est = carbon_estimated(z) if kind == "carbon" else False
            for model, buckets in zone_errors(load(z), kind, year=2024).items():
                for b in buckets:
                    out.append(dict(kind=kind, zone=z, estimated=est, model=model, **asdict(b)))
    return out


def _fit() -> dict:
    from pricing.carbon import hourly_carbon_zones, load_carbon_intensity
    from pricing.electricity import available_price_zones, load_electricity_price
    from pricing.forecast import CARBON_BLEND, PRICE_BLEND
    from pricing.forecast_eval import fit_blend

    out = {}
    for kind, series, used in (("carbon", [load_carbon_intensity(z) for z in hourly_carbon_zones()], CARBON_BLEND),
                               ("price", [load_electricity_price(z) for z in available_price_zones()], PRICE_BLEND)):
        t = time.perf_counter()
        r = fit_blend(series, 2023)
        out[kind] = dict(best=asdict(r.params), in_use=asdict(used), relative_mae_vs_naive_day=r.relative_mae,
                         naive_week_relative_mae=r.naive_week_relative_mae, zones=list(r.zones),
                         fit_s=round(time.perf_counter() - t, 1))
    return out


def _f(v: float, nd: int = 1) -> str:
    return "—" if v != v else f"{v:,.{nd}f}"


def markdown(errors: list[dict], regret: list[RegretRow], fit: dict | None, meta: dict) -> str:
    """The report as Markdown: per zone MAPE (and MAE) by horizon bucket per model, the mean over zones, the
    regret table and the fit. ``meta``: command, machine, commit, date (shown at the top)."""
    from pricing.forecast import MODELS
    from pricing.forecast_eval import HORIZON_BUCKETS

    lines = [f"_Generated by `{meta['command']}` on {meta['machine']}, commit {meta['commit']}, {meta['date']} "
             f"({meta['wall_s']:.0f} s)._", ""]
    names = " / ".join(MODELS)
    for kind, unit in (("carbon", "gCO2e/kWh"), ("price", "USD/MWh")):
        rows = [e for e in errors if e["kind"] == kind]
        zones = list(dict.fromkeys(e["zone"] for e in rows))
        lines += [f"### {kind.capitalize()}: MAPE % by horizon ({names}), 2024", "",
                  "| zone | " + " | ".join(f"{lo}-{hi} h" for lo, hi in HORIZON_BUCKETS) + f" | MAE 48-72 h ({unit}) |",
                  "|---|" + "---|" * (len(HORIZON_BUCKETS) + 1)]
        idx = {(e["zone"], e["model"], e["lo_h"]): e for e in rows}
        for z in zones:
            cells = []
            for lo, _ in HORIZON_BUCKETS:
                vals = [idx[(z, m, lo)]["mape"] for m in MODELS]
                best = min(range(len(vals)), key=lambda i: (vals[i] != vals[i], vals[i]))
                cells.append(" / ".join(f"**{_f(v)}**" if i == best else _f(v) for i, v in enumerate(vals)))
            mae = " / ".join(_f(idx[(z, m, 48)]["mae"]) for m in MODELS)
            est = " (est.)" if any(e["estimated"] for e in rows if e["zone"] == z) else ""
            lines.append(f"| {z}{est} | " + " | ".join(cells) + f" | {mae} |")
        means = []
        for lo, _ in HORIZON_BUCKETS:
            vals = [_mean([idx[(z, m, lo)]["mape"] for z in zones]) for m in MODELS]
            means.append(" / ".join(_f(v) for v in vals))
        maes = " / ".join(_f(_mean([idx[(z, m, 48)]["mae"] for z in zones])) for m in MODELS)
        lines += [f"| **mean of {len(zones)} zones** | " + " | ".join(means) + f" | {maes} |", ""]
        left = _mean([e["mape_left_out"] for e in rows if e["model"] == "blend"])
        if left > 0:
            lines += [f"MAPE leaves out hours with |actual| below the floor (mean share left out: {100 * left:.1f} %); "
                      "MAE counts every hour.", ""]
    lines += ["### Planner regret (federated): forecast run minus perfect-knowledge run, same trace and seed", "",
              f"{meta['jobs']} Philly jobs from {meta['start']} (UTC), step {STEP_S:.0f} s. `onprem`: the bundled "
              "pool moved to the zone, no cloud; `hybrid`: bundled pool + every cloud offer.", "",
              "| scenario | zone | perfect: cost USD, kgCO2e | " + " | ".join(
                  f"{m}: regret USD (%), kgCO2e (%)" for m in REGRET_MODES[1:]) + " |",
              "|---|---|---|" + "---|" * (len(REGRET_MODES) - 1)]
    keyed = {(r.scenario, r.zone, r.model): r for r in regret}
    for s, z in dict.fromkeys((r.scenario, r.zone) for r in regret):
        p = keyed[(s, z, "perfect")]
        cells = []
        for m in REGRET_MODES[1:]:
            r = keyed[(s, z, m)]
            cells.append(f"{r.regret_usd:+,.1f} ({_pct(r.regret_usd, p.cost_usd)}), "
                         f"{r.regret_kg:+,.0f} ({_pct(r.regret_kg, p.carbon_kg)})")
        lines.append(f"| {s} | {z} | {p.cost_usd:,.0f}, {p.carbon_kg:,.0f} | " + " | ".join(cells) + " |")
    on = [r for r in regret if r.scenario == "onprem"]
    if on:
        tot = []
        for m in REGRET_MODES[1:]:
            ru, rk = sum(r.regret_usd for r in on if r.model == m), sum(r.regret_kg for r in on if r.model == m)
            pu = sum(r.cost_usd for r in on if r.model == "perfect")
            pk = sum(r.carbon_kg for r in on if r.model == "perfect")
            tot.append(f"{ru:+,.0f} ({_pct(ru, pu)}), {rk:+,.0f} ({_pct(rk, pk)})")
        lines.append(f"| **onprem, sum of {len(on) // len(REGRET_MODES)} zones** | | | " + " | ".join(tot) + " |")
    lines.append("")
    if fit:
        lines += ["### Fit of the blend parameters (2023)", "",
                  "| kind | best on the grid (alpha, phi, level_h) | in use | MAE / naive_day MAE (mean of zones) "
                  "| naive_week / naive_day |", "|---|---|---|---|---|"]
        for kind, f in fit.items():
            b, u = f["best"], f["in_use"]
            lines.append(f"| {kind} | {b['alpha']}, {b['phi']}, {b['level_h']} | {u['alpha']}, {u['phi']}, "
                         f"{u['level_h']} | {f['relative_mae_vs_naive_day']:.3f} | {f['naive_week_relative_mae']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def _mean(vals: Sequence[float]) -> float:
    v = [x for x in vals if x == x]
    return sum(v) / len(v) if v else float("nan")


def _pct(num: float, den: float) -> str:
    return "—" if den == 0 else f"{100.0 * num / abs(den):+.1f} %"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring and ``--help``."""
    ap = argparse.ArgumentParser(prog="python -m broker.sim.forecast_report", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/forecast"), help="output folder")
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="Philly jobs in the regret window")
    ap.add_argument("--start", default=DEFAULT_START, help="UTC date the regret window starts on (2024)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the spot-trace phases")
    ap.add_argument("--workers", type=int, default=2, help="processes for the regret runs")
    ap.add_argument("--no-fit", action="store_true", help="skip the 2023 grid fit (fit.json)")
    ap.add_argument("--no-hybrid", action="store_true", help="skip the hybrid (cloud) regret runs")
    ap.add_argument("--zones", default=None, help="comma-separated pool zones of the onprem regret runs "
                                                   "(default: every zone with a price series)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs={a.jobs}: must be >= 1")
    if a.workers < 1:
        ap.error(f"--workers={a.workers}: must be >= 1")
    try:
        datetime.fromisoformat(a.start)
    except ValueError:
        ap.error(f"--start={a.start!r}: not an ISO date")
    from pricing.electricity import available_price_zones

    zones = [z.strip() for z in a.zones.split(",") if z.strip()] if a.zones else list(available_price_zones())
    bad = [z for z in zones if z not in available_price_zones()]
    if bad:
        ap.error(f"--zones: {bad} have no price series; choose from {', '.join(available_price_zones())}")
    a.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    errors = error_rows()
    print(f"forecast error: {len(errors)} rows ({time.perf_counter() - t:.0f} s)", flush=True)
    fit = None if a.no_fit else _fit()
    if fit:
        print("fit: " + json.dumps({k: (v["best"], round(v["relative_mae_vs_naive_day"], 3)) for k, v in fit.items()}),
              flush=True)
    regret = regret_rows(zones, a.jobs, a.start, a.seed, a.workers, hybrid=not a.no_hybrid)
    print(f"regret: {len(regret)} runs ({time.perf_counter() - t:.0f} s so far)", flush=True)
    with open(a.out / "forecast_error.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(errors[0]))
        w.writeheader()
        w.writerows(errors)
    with open(a.out / "regret.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(regret[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in regret)
    if fit:
        (a.out / "fit.json").write_text(json.dumps(fit, indent=2))
    cmd = "python -m broker.sim.forecast_report " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    meta = dict(command=cmd.strip(), machine=f"{platform.machine()} {platform.processor() or ''}".strip()
                + f", {__import__('os').cpu_count()} CPUs, Python {platform.python_version()}",
                commit=_commit(), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                wall_s=time.perf_counter() - t, jobs=a.jobs, start=a.start)
    (a.out / "FORECASTS.md").write_text(markdown(errors, regret, fit, meta))
    print(f"wrote {a.out}/FORECASTS.md, forecast_error.csv, regret.csv" + (", fit.json" if fit else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
