"""``fedbroker signals``: the live grid signals the planner decides on (issue 13 item 5).

* ``fedbroker signals status`` — per configured zone, kind and source: the last measured value cached, its age,
  the source's health (ok, stale, never fetched, backing off, no API key) and fetch errors;
* ``fedbroker signals show ZONE [--hours 48] [--kind carbon|price]`` — the hourly series the planner uses from
  now on, with each hour's source, estimated and forecast flags and age;
* ``fedbroker signals refresh [--force]`` — fetch now what beat's ``fedbroker.signals_refresh`` would
  (``--force``: even if this period's fetch was already made);
* ``fedbroker signals seed DIR`` — write ``--signals DIR`` files (the ``simulate --signals`` CSV schema,
  :mod:`pricing.user_signals`) into the cache, as last-known values.

They read the broker's settings (``--config``): its database, Redis and ``signals:`` section, so they are the
operator's tool on the broker's host. ``--json`` prints JSON. Exit 2 for bad input naming the option.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.cloud import ConfigOpt, _database, _settings
from broker.cli.console import JsonOpt, current_console, echo_json, fail

__all__ = ["signals_app", "register"]

signals_app = typer.Typer(no_args_is_help=True, help="Live grid signals: sources' health, the planner's series, "
                                                     "refresh, seeding from CSV files.")


def _cache(config: Optional[Path]):
    import redis

    from broker.service.signal_cache import SignalCache
    from broker.service.store.core import JobStore

    st = _settings(config)
    store = JobStore.from_settings(st)
    r = redis.Redis.from_url(st.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return st, SignalCache(store, r, st.signals)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 3600.0:.1f} h" if s >= 3600 else f"{s / 60.0:.0f} min"


@signals_app.command("status")
def status_cmd(config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Each configured zone's sources: last value, age, health and fetch errors."""
    st, cache = _cache(config)
    if not (st.signals.enabled or st.signals.cloud_enabled):
        msg = "no signals: section: every zone replays the bundled 2023-24 history (see README, Live signals)"
        if as_json:
            echo_json([])
        else:
            current_console().print(msg)
        return
    with _database(st):
        rows = cache.health()
    if as_json:
        echo_json(rows)
        return
    tab = Table(title="live signal sources")
    for col in ("zone", "kind", "source", "last value", "hour (UTC)", "age", "health", "errors"):
        tab.add_column(col, justify="right" if col in ("last value", "age") else "left")
    for e in rows:
        unit = "gCO2e/kWh" if e["kind"] == "carbon" else "USD/MWh"
        tab.add_row(escape(e["zone"]), e["kind"], escape(e["source"]),
                    "-" if e["last_value"] is None else f"{e['last_value']:.1f} {unit}", e["last_hour"] or "-",
                    _age(e["age_s"]), escape(e["health"]),
                    ", ".join(f"{k} {v}" for k, v in sorted(e["errors"].items())) or "-")
    current_console().print(tab)


@signals_app.command("show")
def show_cmd(zone: str = typer.Argument(..., help="Grid zone (a pool's carbon/price zone or a cloud region's)."),
             hours: int = typer.Option(48, "--hours", help="Hours from now, 1..240."),
             kind: str = typer.Option("both", "--kind", help="carbon, price or both."),
             config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """The hourly series the planner uses for ZONE from now on, with source, estimated and forecast flags."""
    from broker.service.live import LiveEnvironment, series_rows
    from pricing.errors import UnknownZoneError

    if not 1 <= hours <= 240:
        fail(f"--hours={hours}: must be 1..240", code=2)
    if kind not in ("carbon", "price", "both"):
        fail(f"--kind={kind!r}: choose carbon, price or both", code=2)
    st, cache = _cache(config)
    try:  # a bad cluster file (a pool zone without series, a malformed pool): one line, not a traceback
        env = LiveEnvironment(st.planner, st.cluster, signals=(st.signals, cache) if st.signals.enabled else None)
    except (ValueError, OSError) as e:
        fail(f"cluster={str(st.cluster)!r}: {e}", code=2)
    now = time.time()
    sig = env.signals_at(now)
    out = {}
    try:
        with _database(st):
            for k in (("carbon", "price") if kind == "both" else (kind,)):
                out[k] = series_rows(sig, zone, k, now, hours)
    except UnknownZoneError:
        fail(f"ZONE={zone!r}: not a zone of the cluster's pools or cloud offers "
             f"({', '.join(env.base_signals.zones)})", code=2)
    if as_json:
        echo_json({"zone": zone, "hours": hours, **out})
        return
    tab = Table(title=f"{zone}: the series the planner uses (UTC hours)")
    tab.add_column("hour (UTC)")
    for k in out:
        unit = "gCO2e/kWh" if k == "carbon" else "USD/MWh"
        tab.add_column(f"{k} {unit}", justify="right")
        tab.add_column(f"{k} source")
    for i in range(hours):
        cells = [out[next(iter(out))][i]["hour"]]
        for k in out:
            r = out[k][i]
            flags = "".join(f for f, on in ((" forecast", r["forecast"]), (" estimated", r["estimated"])) if on)
            cells += ["-" if r["value"] is None else f"{r['value']:.1f}",
                      escape(r["source"] + (f" ({flags.strip()})" if flags else "")
                             + (f", {_age(r['age_s'])} old" if r["age_s"] is not None else ""))]
        tab.add_row(*cells)
    current_console().print(tab)


@signals_app.command("refresh")
def refresh_cmd(force: bool = typer.Option(False, "--force", help="Fetch even if this period's fetch was made."),
                config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Fetch the configured zones' sources and cloud prices now (as beat's signals_refresh does); exit 1 if any
    fetch failed."""
    st, cache = _cache(config)
    with _database(st):
        res = cache.refresh_all(force=force)
        if st.signals.cloud_enabled:  # signals.cloud_prices: one entry per provider (zone = aws/gcp, kind = cloud)
            res += cache.refresh_cloud(force=force)
    rows = [{"zone": r.zone, "kind": r.kind, "claimed": r.claimed, "fetched": r.fetched, "errors": r.errors,
             "skipped": r.skipped} for r in res]
    if as_json:
        echo_json(rows)
    else:
        for r in rows:
            what = ("already fetched this period (another process)" if not r["claimed"] else
                    "; ".join([f"{k}: {v} h" for k, v in r["fetched"].items()]
                              + [f"{k}: {v}" for k, v in {**r["errors"], **r["skipped"]}.items()]) or "nothing")
            current_console().print(f"{escape(r['zone'])} {r['kind']}: {escape(what)}")
    if any(r["errors"] for r in rows):
        raise typer.Exit(1)


@signals_app.command("seed")
def seed_cmd(folder: Path = typer.Argument(..., help="Folder of CSV files (zone,hour_utc,value,unit,quality)."),
             config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Write hourly series from CSV files into the cache (source 'user', used as last-known values)."""
    from pricing.user_signals import UserSignalsError, load_user_signals

    try:
        user = load_user_signals(folder)
    except UserSignalsError as e:
        fail(str(e), code=2)
    st, cache = _cache(config)
    with _database(st):
        out = cache.seed(user)
    if as_json:
        echo_json(out)
    else:
        for k, n in out.items():
            current_console().print(f"{k}: {n} h seeded")


def register(app: typer.Typer) -> None:
    """Add ``fedbroker signals`` to ``app``."""
    app.add_typer(signals_app, name="signals")
