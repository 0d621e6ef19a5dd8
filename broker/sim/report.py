"""Reports for simulated policy runs: ``results.json``, a self-contained HTML page, tables.

* :func:`write_report` writes ``results.json`` (machine-readable metrics) and
  ``report.html`` (one file, no external assets: the plots are PNGs rendered
  with matplotlib's Agg canvas and embedded as base64 ``data:`` URIs).
* :func:`write_job_csv` writes one run's per-job records as CSV (columns and
  units in :data:`JOB_CSV_COLUMNS`).
* :func:`chargeback_summary` is the one-line chargeback of a run (what ``simulate`` prints);
  ``report.html`` has a chargeback table per policy (:func:`broker.usage.chargeback` of the run's usage
  records: per team cloud, on-prem energy and amortised USD, kWh, kgCO2e, GPU-hours), the main policy's
  (``federated`` when it ran, else the first) open, the others folded.
* :func:`comparison_table` returns a :class:`rich.table.Table`; :func:`markdown_table`
  the same table as GitHub Markdown (for the README).

Rows are the metrics of :data:`broker.sim.results.METRIC_KEYS` in that order (units
from there), then any extra metric keys the runs carry, sorted; columns are the
policies in the order of the ``runs`` mapping. Numbers are human-formatted:
counts with thousands separators, seconds as s/min/h/d, USD with ``$``,
fractions as percent; a missing or NaN value prints as an em dash.

Plots (each downsampled to at most :data:`MAX_PLOT_POINTS` points per line so
that 4 runs of ~100k samples render in well under 5 s):

1. cumulative cost over time, USD (one line per policy, UTC dates on x);
2. cumulative carbon over time, kgCO2e;
3. spend per team, USD: grouped bars, the 10 teams with the largest spend
   summed over policies;
4. wait-time distribution: empirical CDF on a log x axis (waits below 1 s are
   drawn at 1 s);
5. on-prem utilisation over time: busy GPUs / on-prem GPUs (bin means);
6. with a carbon-price sweep: cost against carbon, one line per policy and one for the LP bound, one
   marker per carbon price (:data:`FRONTIER_TEXT` says how to read it), with a table of the scores and
   their ratios to the bound's.

Raises ``OSError`` if ``out_dir`` cannot be created or written.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from dataclasses import asdict, is_dataclass
from datetime import date, datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from broker.sim.results import METRIC_KEYS, PolicyRun
from broker.usage import CHARGEBACK_COLUMNS
from broker.utc import iso_seconds

__all__ = ["write_report", "chargeback_summary", "CHARGEBACK_TEXT", "comparison_table", "frontier_table",
           "markdown_table", "format_value", "to_jsonable",
           "MAX_PLOT_POINTS", "FRONTIER_TEXT"]

#: Upper bound on points per plotted line.
MAX_PLOT_POINTS = 2000
_TOP_TEAMS = 10
_DASH = "\u2014"


# --------------------------------------------------------------------------- JSON


def to_jsonable(obj: Any) -> Any:
    """Convert ``obj`` to plain JSON types: numpy scalars/arrays -> Python, NaN/inf -> ``None``,
    enums -> value, datetimes -> ISO 8601, paths -> str, dataclasses -> dict, non-str keys -> str."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, (datetime, date)):
        return obj.isoformat()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.ndarray):
        return [to_jsonable(x) for x in obj.tolist()]
    if isinstance(obj, Mapping):
        return {str(to_jsonable(k)) if not isinstance(k, str) else k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(x) for x in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(asdict(obj))
    if hasattr(obj, "model_dump"):
        return to_jsonable(obj.model_dump(mode="json"))
    return str(obj)


# --------------------------------------------------------------------------- formatting


def _finite(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _duration(s: float) -> str:
    a = abs(s)
    if a < 120:
        return f"{s:,.1f} s"
    if a < 3600:
        return f"{s / 60:,.1f} min"
    if a < 2 * 86400:
        return f"{s / 3600:,.1f} h"
    return f"{s / 86400:,.1f} d"


def _number(f: float) -> str:
    a = abs(f)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{f:,.0f}"
    if a >= 1:
        return f"{f:,.2f}"
    return f"{f:.3g}"


def format_value(value: Any, unit: str) -> str:
    """Human-format one metric ``value`` in ``unit`` (a :data:`METRIC_KEYS` unit); NaN/None -> em dash."""
    f = _finite(value)
    if f is None:
        return _DASH
    if unit in ("jobs", "count"):
        return f"{f:,.0f}" if f == int(f) else f"{f:,.1f}"
    if unit == "s":
        return _duration(f)
    if unit == "USD":
        sign = "-" if f < 0 else ""
        return f"{sign}${abs(f):,.0f}" if abs(f) >= 100 else f"{sign}${abs(f):,.2f}"
    if unit == "fraction":
        return f"{100 * f:.1f} %"
    if unit == "ms":
        return f"{f:,.2f} ms" if abs(f) < 100 else f"{f:,.0f} ms"
    return _number(f)


def _rows(runs: Mapping[str, PolicyRun]) -> list[tuple[str, str]]:
    keys = list(METRIC_KEYS.items())
    extra = sorted({k for r in runs.values() for k in r.metrics} - set(METRIC_KEYS))
    return keys + [(k, "") for k in extra]


def _cells(runs: Mapping[str, PolicyRun]) -> list[tuple[str, str, list[str]]]:
    return [(k, u, [format_value(r.metrics.get(k), u) for r in runs.values()]) for k, u in _rows(runs)]


def comparison_table(runs: Mapping[str, PolicyRun]):
    """A :class:`rich.table.Table`: rows = metrics (with unit), columns = policies, human-formatted."""
    from rich.table import Table

    t = Table(title="Policy comparison", show_lines=False)
    t.add_column("metric", style="bold")
    t.add_column("unit", style="dim")
    for name in runs:
        t.add_column(str(name), justify="right")
    for k, u, vals in _cells(runs):
        t.add_row(k, u, *vals)
    return t


def _frontier_cells(frontier: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the frontier table: per carbon price, the bound's cost, carbon and score, then each
    policy's score with its ratio to the bound's score at that price."""
    names = list(frontier[0]["policies"]) if frontier else []
    has_bound = any(e["bound"] for e in frontier)
    head = ["carbon price USD/tCO2e"] + (["bound cost USD", "bound kgCO2e", "bound score USD"] if has_bound else [])
    head += [f"{n} score (x bound)" if has_bound else f"{n} score" for n in names]
    rows = []
    for e in frontier:
        b = e["bound"]
        row = [f"${e['carbon_price_usd_per_t']:,.0f}"]
        if has_bound:
            row += [format_value(b["cost_usd"], "USD"), format_value(b["carbon_kg"], "kgCO2e"),
                    format_value(b["score_usd"], "USD")] if b else [_DASH] * 3
        for n in names:
            m = e["policies"][n]
            ratio = _finite(m.get("score_ratio_to_bound"))
            late = _finite(m.get("deadline_misses")) or 0  # the bound is for schedules without
            notes = ([f"{ratio:.2f}x"] if ratio is not None else []) + ([f"{late:,.0f} late"] if late else [])
            row.append(format_value(m["score_usd"], "USD") + (f" ({'; '.join(notes)})" if notes else ""))
        rows.append(row)
    return head, rows


def frontier_table(frontier: list[dict]):
    """A :class:`rich.table.Table` of the carbon-price sweep (the ``"frontier"`` of results.json)."""
    from rich.table import Table

    head, rows = _frontier_cells(frontier)
    t = Table(title="Carbon-price frontier: scores (cost + price x carbon) and ratios to the bound's at each price")
    for i, h in enumerate(head):
        t.add_column(h, justify="right", style="bold" if i == 0 else None)
    for r in rows:
        t.add_row(*r)
    return t


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def markdown_table(runs: Mapping[str, PolicyRun]) -> str:
    """The comparison table as GitHub Markdown (metric | unit | one column per policy), ending in a newline."""
    names = [_md(str(n)) for n in runs]
    lines = ["| metric | unit | " + " | ".join(names) + " |",
             "|---|---|" + "---:|" * len(names)]
    for k, u, vals in _cells(runs):
        lines.append(f"| {_md(k)} | {_md(u)} | " + " | ".join(_md(v) for v in vals) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _pick(n: int, k: int = MAX_PLOT_POINTS) -> np.ndarray:
    """At most ``k`` evenly spaced indices of ``range(n)``, always including the first and last."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def _bin_mean(t: np.ndarray, y: np.ndarray, k: int = MAX_PLOT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """Downsample to ``k`` bins of consecutive samples: mean time and mean value per bin."""
    n = len(t)
    if n <= k:
        return t, y
    edges = np.linspace(0, n, k + 1).astype(np.int64)
    cs_t = np.concatenate(([0.0], np.cumsum(t, dtype=float)))
    cs_y = np.concatenate(([0.0], np.cumsum(y, dtype=float)))
    cnt = np.diff(edges)
    keep = cnt > 0
    lo, hi = edges[:-1][keep], edges[1:][keep]
    return (cs_t[hi] - cs_t[lo]) / cnt[keep], (cs_y[hi] - cs_y[lo]) / cnt[keep]


def _dates(t_s: np.ndarray) -> np.ndarray:
    return (np.asarray(t_s, dtype=float) * 1000).round().astype(np.int64).astype("datetime64[ms]")


def _colors(names: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
               "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def _fig(title: str, ylabel: str, xlabel: str = "") -> tuple[Any, Any]:
    # matplotlib is imported here, not at module import, to keep CLI start-up fast; the
    # Agg canvas is attached directly (no pyplot, no global backend switch).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _date_axis(ax) -> None:
    import matplotlib.dates as mdates

    loc = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc))
    ax.set_xlabel("date (UTC)")


def _plot_cumulative(runs: Mapping[str, PolicyRun], attr: str, title: str, ylabel: str, colors) -> str:
    fig, ax = _fig(title, ylabel)
    any_data = False
    for name, r in runs.items():
        t = np.asarray(r.timeline_t_s, dtype=float)
        y = np.asarray(getattr(r, attr), dtype=float)
        n = min(len(t), len(y))
        if n == 0:
            continue
        idx = _pick(n)
        ax.plot(_dates(t[idx]), y[idx], label=str(name), color=colors[name], lw=1.5)
        any_data = True
    if any_data:
        _date_axis(ax)
        ax.legend(loc="upper left")
    else:
        _no_data(ax)
    return _png(fig)


def _plot_teams(runs: Mapping[str, PolicyRun], colors) -> str:
    fig, ax = _fig(f"Spend per team (top {_TOP_TEAMS} teams by total spend)", "USD")
    totals: dict[str, float] = {}
    for r in runs.values():
        for team, v in r.team_cost_usd.items():
            f = _finite(v)
            if f is not None:
                totals[team] = totals.get(team, 0.0) + f
    teams = sorted(totals, key=lambda k: (-totals[k], k))[:_TOP_TEAMS]
    if teams:
        x = np.arange(len(teams))
        w = 0.8 / max(1, len(runs))
        for i, (name, r) in enumerate(runs.items()):
            vals = [_finite(r.team_cost_usd.get(tm)) or 0.0 for tm in teams]
            ax.bar(x + (i - (len(runs) - 1) / 2) * w, vals, width=w, label=str(name), color=colors[name])
        ax.set_xticks(x)
        ax.set_xticklabels(teams, rotation=30, ha="right")
        ax.set_xlabel("team")
        ax.legend()
    else:
        _no_data(ax)
    return _png(fig)


def _plot_waits(runs: Mapping[str, PolicyRun], colors) -> str:
    fig, ax = _fig("Wait-time distribution (CDF)", "fraction of completed jobs", "wait, s (log; < 1 s drawn at 1 s)")
    any_data = False
    for name, r in runs.items():
        w = np.asarray(r.waits_s, dtype=float)
        w = w[np.isfinite(w)]
        if len(w) == 0:
            continue
        w = np.sort(np.maximum(w, 1.0))
        frac = np.arange(1, len(w) + 1) / len(w)
        idx = _pick(len(w))
        ax.step(w[idx], frac[idx], where="post", label=str(name), color=colors[name], lw=1.5)
        any_data = True
    if any_data:
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right")
    else:
        _no_data(ax)
    return _png(fig)


def _plot_util(runs: Mapping[str, PolicyRun], colors) -> str:
    fig, ax = _fig("On-prem GPU utilisation", "fraction of on-prem GPUs busy")
    any_data = False
    for name, r in runs.items():
        t = np.asarray(r.timeline_t_s, dtype=float)
        b = np.asarray(r.onprem_busy_gpus, dtype=float)
        n = min(len(t), len(b))
        if n == 0 or r.onprem_total_gpus <= 0:
            continue
        tt, bb = _bin_mean(t[:n], b[:n])
        ax.plot(_dates(tt), bb / r.onprem_total_gpus, label=str(name), color=colors[name], lw=1.0, alpha=0.85)
        any_data = True
    if any_data:
        _date_axis(ax)
        ax.set_ylim(0, 1.05)
        ax.legend(loc="lower right")
    else:
        _no_data(ax)
    return _png(fig)


#: one marker per carbon price of the frontier plot (in price order, cycled), the same on every line
_PRICE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")


def _plot_frontier(frontier: list[dict], colors) -> str:
    """Cost (USD, y) against carbon (kgCO2e, x): one line per policy and one for the bound through their points at
    each carbon price; each price has its marker (:data:`_PRICE_MARKERS`, a legend of its own), a policy that
    does not use the carbon price is one star (its one run)."""
    from matplotlib.lines import Line2D

    fig, ax = _fig("Cost vs carbon as the carbon price sweeps", "cost, USD", "carbon, kgCO2e")
    prices = [e["carbon_price_usd_per_t"] for e in frontier]
    marks = [_PRICE_MARKERS[i % len(_PRICE_MARKERS)] for i in range(len(prices))]
    handles = []

    def line(xs, ys, label, color, style, one_point: bool):
        if one_point:  # a policy that ignores the carbon price: one run, the same point at every price
            ax.plot(xs[:1], ys[:1], "*", color=color, ms=11)
            handles.append(Line2D([], [], color=color, marker="*", ls="", ms=11, label=f"{label} (any price)"))
            return
        ax.plot(xs, ys, style, color=color, lw=1.3)
        for x, y, m in zip(xs, ys, marks):
            ax.plot([x], [y], m, color=color, ms=6)
        handles.append(Line2D([], [], color=color, ls=style, label=label))

    if frontier and any(e["bound"] for e in frontier):
        pts = [(e["bound"]["carbon_kg"], e["bound"]["cost_usd"]) for e in frontier if e["bound"]]
        line([x for x, _ in pts], [y for _, y in pts], "LP bound", "black", "--", False)
    for name in (frontier[0]["policies"] if frontier else []):
        ms = [e["policies"][name] for e in frontier]
        line([m["carbon_kg"] for m in ms], [m["cost_usd"] for m in ms], str(name), colors.get(name, "#333333"),
             "-", not ms[0]["uses_carbon_price"])
    if frontier:
        first = ax.legend(handles=handles, loc="upper left", fontsize=8)
        ax.add_artist(first)
        # "\\$": a literal dollar sign, not mathtext
        ax.legend(handles=[Line2D([], [], color="gray", marker=m, ls="", label=f"\\${p:,.0f}/t")
                           for p, m in zip(prices, marks)], loc="lower right", fontsize=8, title="carbon price",
                  title_fontsize=8)
    else:
        _no_data(ax)
    return _png(fig)


#: how to read the frontier plot and table (the report's text; README "What `make demo` prints" says the same)
FRONTIER_TEXT = (
    "Each point is a (carbon, cost) pair at one carbon price; its marker says which price (the legend 'carbon "
    "price'). A policy's point is its run at that price; fifo, backfill and cheapest do not use the carbon price, "
    "so one run serves every price: one star, only its score changes. The bound's point at a price is the LP relaxation's schedule of least score "
    "(cost + price x carbon / 1000): no schedule that meets every deadline scores less at that price, so the "
    "region below and left of the line through the point with slope -price/1000 is out of reach. As the price "
    "rises the bound's carbon does not rise and its cost does not fall. The table gives each policy's score at "
    "each price and its ratio to the bound's score at the same price (1.00x: provably optimal; the target is "
    "1.5x or less at every price). Cost is the dollars the score counts: cost_usd, plus the on-prem amortised "
    "capital when onprem_cost_basis is 'amortised'.")


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 10px}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555;font-size:90%}
.dim{color:#777}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _kv_table(d: Mapping[str, Any]) -> str:
    if not d:
        return "<p class='dim'>none</p>"
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(json.dumps(to_jsonable(v)) if not isinstance(v, str) else v)}</td></tr>"
                   for k, v in d.items())
    return f"<table>{rows}</table>"


#: how to read the chargeback table (report.html)
CHARGEBACK_TEXT = (
    "What each team would be charged, from the run's usage records (the same records and rules as the live "
    "ledger: usage-POLICY.csv.gz). Cloud: each instance billed by the provider's rule (per second, 60-s "
    "minimum) at list price. On-prem energy: modelled power x PUE at the pool zone's hourly tariff. Amortised: "
    "the pool's capital per GPU-hour, its own line (not in cost_usd). kgCO2e: location-based (the zone's "
    "hourly average intensity). GPU-hours: cloud instances' and on-prem ranks' GPUs x hours run. A line with "
    "an unknown figure (an hour outside the price or carbon data) counts 0 here and is flagged in the records.")
_CB_HEAD = ("team", "cloud USD", "on-prem energy USD", "amortised USD", "total USD", "kWh", "kgCO2e", "GPU-hours")


def _usd(v: float) -> str:
    return format_value(v, "USD")


def _cb_total(cb: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {k: sum(t[k] for t in cb.values()) for k in CHARGEBACK_COLUMNS}


def chargeback_summary(policy: str, cb: Mapping[str, Mapping[str, float]]) -> str:
    """One line: ``chargeback (federated): 14 teams, $X (cloud $A, on-prem energy $B, amortised $C), N kWh,
    M kgCO2e, G GPU-h; top team T $Y (P %)`` (``cb`` from :func:`broker.usage.chargeback`, highest first)."""
    if not cb:
        return f"chargeback ({policy}): no usage"
    tot = _cb_total(cb)
    top, t = next(iter(cb.items()))
    share = f" ({100 * t['total_usd'] / tot['total_usd']:.0f} %)" if tot["total_usd"] > 0 else ""
    unknown = f"; {tot['unknown_lines']:,.0f} lines with an unknown figure" if tot["unknown_lines"] else ""
    return (f"chargeback ({policy}): {len(cb)} team{'s' if len(cb) != 1 else ''}, {_usd(tot['total_usd'])} "
            f"(cloud {_usd(tot['cloud_usd'])}, on-prem energy {_usd(tot['onprem_energy_usd'])}, amortised "
            f"{_usd(tot['amortised_usd'])}), {_number(tot['energy_kwh'])} kWh, {_number(tot['carbon_kg'])} kgCO2e, "
            f"{_number(tot['gpu_hours'])} GPU-h; top team {top} {_usd(t['total_usd'])}{share}{unknown}")


def _cb_row(name: str, t: Mapping[str, float], tag: str = "td") -> str:
    cells = [_usd(t["cloud_usd"]), _usd(t["onprem_energy_usd"]), _usd(t["amortised_usd"]), _usd(t["total_usd"]),
             _number(t["energy_kwh"]), _number(t["carbon_kg"]), _number(t["gpu_hours"])]
    return f"<tr><th>{_e(name)}</th>" + "".join(f"<{tag} class='num'>{_e(c)}</{tag}>" for c in cells) + "</tr>"


def _chargeback_html(runs: Mapping[str, PolicyRun]) -> str:
    with_cb = {n: r.chargeback for n, r in runs.items() if r.chargeback}
    if not with_cb:
        return ""
    main = "federated" if "federated" in with_cb else next(iter(with_cb))
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in _CB_HEAD) + "</tr>"
    parts = []
    for name in [main] + [n for n in with_cb if n != main]:
        cb = with_cb[name]
        rows = "".join(_cb_row(team, t) for team, t in cb.items()) + _cb_row("all teams", _cb_total(cb), "th")
        parts.append(f"<details{' open' if name == main else ''} id='chargeback-{_e(name)}'><summary>"
                     f"{_e(chargeback_summary(name, cb))}</summary><table class='chargeback'>{head}{rows}</table>"
                     "</details>")
    return (f"<h2>Chargeback</h2><p>{_e(CHARGEBACK_TEXT)} Per policy; {_e(main)} open, click another to "
            f"unfold it.</p>" + "".join(parts))


def _frontier_html(frontier: list[dict], b64: str) -> str:
    head, rows = _frontier_cells(frontier)
    body = "".join("<tr>" + "".join(f"<td class='num'>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    cap = "Cost vs carbon as the carbon price sweeps (policies and the LP bound)"
    return (f"<h2>Carbon-price frontier</h2><p>{_e(FRONTIER_TEXT)}</p>"
            f"<figure><img alt='{_e(cap)}' src='data:image/png;base64,{b64}'><figcaption>{_e(cap)}</figcaption>"
            f"</figure><table><tr>{''.join(f'<th>{_e(h)}</th>' for h in head)}</tr>{body}</table>")


def _html(runs: Mapping[str, PolicyRun], meta: Mapping[str, Any], images: list[tuple[str, str]],
          bound: Mapping[str, Any] | None = None, frontier_html: str = "") -> str:
    names = list(runs)
    head = "<tr><th>metric</th><th>unit</th>" + "".join(f"<th>{_e(n)}</th>" for n in names) + "</tr>"
    body = []
    for k, u in _rows(runs):
        tds = []
        for r in runs.values():
            v = r.metrics.get(k)
            raw = to_jsonable(v)
            tds.append(f"<td class='num' title='{_e(raw)}'>{_e(format_value(v, u))}</td>")
        body.append(f"<tr><th>{_e(k)}</th><td class='dim'>{_e(u)}</td>{''.join(tds)}</tr>")
    skipped_rows = "".join(
        f"<tr><th>{_e(n)}</th><td>{_e(', '.join(f'{k}: {v}' for k, v in r.skipped.items()) or 'none')}</td></tr>"
        for n, r in runs.items())
    figs = "".join(
        f"<figure><img alt='{_e(cap)}' src='data:image/png;base64,{b64}'><figcaption>{_e(cap)}</figcaption></figure>"
        for cap, b64 in images)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>fedbroker policy report</title><style>{_CSS}</style></head><body>"
        f"<h1>fedbroker policy report</h1><p class='dim'>generated {generated}</p>"
        f"<h2>Metrics</h2><table>{head}{''.join(body)}</table>"
        + (f"<h2>Lower bound (LP relaxation)</h2>{_kv_table(bound)}" if bound else "")
        + frontier_html
        + _chargeback_html(runs)
        + f"<h2>Plots</h2>{figs}"
        f"<h2>Skipped</h2><table>{skipped_rows}</table>"
        f"<h2>Run parameters</h2>{_kv_table(meta)}"
        "</body></html>"
    )


#: per-job CSV column -> meaning and unit (from :class:`broker.sim.results.JobRecord`).
#: Times are UTC ISO 8601 to the second; an empty cell means "does not apply" (never
#: started, on-prem market, rejected job's deadline_met).
JOB_CSV_COLUMNS: dict[str, str] = {
    "job_id": "trace job id",
    "team": "team",
    "gpus": "GPUs requested (all nodes)",
    "status": "completed, rejected or unfinished",
    "submit": "submission, UTC",
    "start": "first start, UTC (cloud: instance ready)",
    "end": "finish, UTC",
    "placement": "pool name or cloud offer id of the latest start",
    "market": "spot or on_demand (empty on-prem)",
    "dollars_usd": "cloud bills + on-prem electricity, USD (sums to cost_usd)",
    "amortised_usd": "on-prem capital share, USD (sums to onprem_amortised_usd)",
    "energy_kwh": "facility energy, kWh",
    "carbon_kg": "emissions, kgCO2e",
    "wait_s": "first start - submit, seconds",
    "deadline": "deadline, UTC",
    "deadline_met": "true if it finished by the deadline (false if unfinished; empty if rejected)",
    "starts": "on-prem starts + cloud provisions",
}


def _utc(t: float) -> str:
    return "" if math.isnan(t) else iso_seconds(t)


def write_job_csv(run: PolicyRun, path: Path) -> Path:
    """Write ``run.jobs`` to ``path`` as CSV, one row per job, columns :data:`JOB_CSV_COLUMNS`.

    Numbers are written with ``repr`` precision. Returns ``path``. Raises ``OSError``
    if it cannot be written.
    """
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(JOB_CSV_COLUMNS)
        for j in run.jobs:
            met = j.deadline_met
            w.writerow([j.job_id, j.team, j.gpus, j.status, _utc(j.submit_s), _utc(j.start_s), _utc(j.end_s),
                        j.placement, j.market, repr(j.dollars_usd), repr(j.amortised_usd), repr(j.energy_kwh),
                        repr(j.carbon_kg), "" if math.isnan(j.wait_s) else repr(j.wait_s), _utc(j.deadline_s),
                        "" if met is None else str(met).lower(), j.starts])
    return path


def write_report(runs: dict[str, PolicyRun], out_dir: Path, meta: dict, bound: dict | None = None,
                 frontier: list[dict] | None = None) -> tuple[Path, Path]:
    """Write ``out_dir/results.json`` and ``out_dir/report.html``; return their paths ``(json, html)``.

    ``results.json`` is ``{"policies": {name: metrics}, "meta": meta, "skipped": {name: {reason: count}}}``
    (and ``"bound": bound`` when given: the LP lower bound, :meth:`broker.sim.bound.LowerBound.as_json`;
    ``"frontier": frontier`` when given: the carbon-price sweep, :func:`broker.sim.sweep.frontier_entries`;
    ``"chargeback"``: policy -> team -> :data:`broker.usage.CHARGEBACK_COLUMNS`, for runs with usage records)
    with numpy values converted and NaN/inf written as ``null``. ``report.html`` is
    self-contained (metrics table, 5 embedded PNG plots, with a frontier the frontier plot, table and
    :data:`FRONTIER_TEXT`, the chargeback tables, skip counts, ``meta``).
    ``out_dir`` is created if needed. Raises ``OSError`` if it cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "policies": {str(n): to_jsonable(r.metrics) for n, r in runs.items()},
        "meta": to_jsonable(meta or {}),
        "skipped": {str(n): to_jsonable(r.skipped) for n, r in runs.items()},
    }
    if bound is not None:
        doc["bound"] = to_jsonable(bound)
    if frontier is not None:
        doc["frontier"] = to_jsonable(frontier)
    cbs = {str(n): to_jsonable(r.chargeback) for n, r in runs.items() if r.chargeback}
    if cbs:
        doc["chargeback"] = cbs
    jpath = out / "results.json"
    jpath.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")

    colors = _colors(list(runs))
    images = [
        ("Cumulative cost over time (USD)",
         _plot_cumulative(runs, "cum_cost_usd", "Cumulative cost", "USD", colors)),
        ("Cumulative carbon over time (kgCO2e)",
         _plot_cumulative(runs, "cum_carbon_kg", "Cumulative carbon", "kgCO2e", colors)),
        (f"Spend per team, top {_TOP_TEAMS} teams (USD)", _plot_teams(runs, colors)),
        ("Wait-time distribution, CDF (log x)", _plot_waits(runs, colors)),
        ("On-prem GPU utilisation over time (fraction busy)", _plot_util(runs, colors)),
    ]
    hpath = out / "report.html"
    front = _frontier_html(frontier, _plot_frontier(frontier, colors)) if frontier else ""
    hpath.write_text(_html(runs, meta or {}, images, bound, front), encoding="utf-8")
    return jpath, hpath
