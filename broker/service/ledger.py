"""The usage ledger (issue #12): meters each ended attempt once, in the transaction that ends it.

:func:`broker.service.lifecycle.close_attempt` calls :func:`broker.service.lifecycle.record_usage` once per
attempt; that calls :func:`meter_attempt` (the records) and :func:`broker.service.store.usage.add_usage`
(the rows, skipping any already written: a replayed end meters once). Nothing here commits: the records
are in the caller's transaction, so a crash leaves the attempt un-ended *and* un-metered, never half.

What each line costs (one cost model: :mod:`broker.planner.costs`; billing rules: :mod:`pricing.billing`):

* **cloud** (``line="instance"``), one per instance the attempt ran on (``cloud_instances`` rows with a
  provider instance id that the attempt's placement names; failed-over gang members and instances of an
  attempt that never ran are ``idle`` lines, below): from the create call (the intent row's ``created_at``;
  boot and image pull are the job's: it asked for them) to the attempt's end (or the instance's deletion or
  stop, if earlier);
  ``billed_s`` by :func:`pricing.billing.billed_seconds`; USD: each UTC hour of the billed seconds (counted from
  the create call) at the price that applied in it (:class:`CloudPrice`, the one home of this rule): **spot**
  the cached hourly spot price of that offer for that hour (the live cloud price cache, ``signals.cloud_prices``:
  AWS bills spot at the price in force, time-weighted per hour), **on-demand** the live list price cached at
  launch; where the cache has no value, the USD/h the provisioner priced the offer at when it wrote the intent
  (``cloud_instances.launch_usd_per_hour``: the price the planner used), else the bundled catalog price. The
  line's ``price_source`` says which (joined by ``+`` when hours differ); a launch price standing in for a
  missing live price, a catalog price, or a cached price the feed marked estimated flags the line. With no
  live cloud prices configured the launch price *is* the price in force (the catalog the planner used), not
  flagged. Energy: modelled power (every GPU of the instance busy, :func:`pricing.power.
  gpu_power_w` at its default utilisation) x the provider's PUE (flagged: cloud instances give no counter);
  kgCO2e at the region's hourly carbon intensity.
* **on-prem**, per rank (one node's GPUs), from the attempt's start to its end: ``line="energy"``: the
  GPUs' NVML total-energy counters (read at the start by :func:`snapshot_counters`, at the end from the
  node's last heartbeat): their mean power over the attempt's window (flagged when the readings' window
  differs from the run by more than 5 %, or 1 s, whichever is more), x
  the pool's PUE, priced at the pool's price zone's hourly tariff and carbon
  (:func:`~broker.planner.costs.onprem_cost` with the counter's mean power); the tariff and carbon hours are
  the live planner's: for a zone the ``signals:`` section configures, the same chain
  (:meth:`broker.service.live.LiveEnvironment.billing_signals`: fresh measured value, last known, forecast
  model, bundled replay) with each hour's value judged at that hour; an hour whose value is not a measurement
  from a configured source flags the line (``price_source``: the tariff hours' origins; the carbon hours'
  origins in the reasons); other zones: the bundled replay as before (``price_source`` ``bundled-replay``); where a GPU has no counter,
  the mean of its sampled power at the two readings (flagged), else the modelled power (flagged);
  ``line="amortised"``: GPUs x hours x the pool's amortised USD/GPU-h, its own line.
* an existing scheduler's pool (``attempt.kind`` a pool kind: ``slurm``), one job for all its nodes: the same
  ``energy`` and ``amortised`` lines, over the run the scheduler reports (``elapsed_s``, else the attempt's
  start to its end), with the energy the scheduler accounted (Slurm ``sacct`` ``ConsumedEnergyRaw``, J) where it
  has it, else the modelled power of its GPUs (flagged), x the pool's PUE; ``resource`` is ``slurm:<job id>``.
  The adapter's figures are kept on the attempt (``attempt.meter["scheduler"]``) by the watch that ends it.
* kgCO2e is **location-based**: the grid zone's average hourly intensity, not market-based contracts.
* A missing hour of price or carbon inside a window is interpolated from the nearest hours within
  :data:`FILL_HOURS` (flagged); farther than that, or outside the series, the figure is ``None`` with
  the reason (never 0). A rank that never reported its end is metered to the attempt's end (flagged).

* **what only an instance's deletion decides** (:func:`meter_instance_ends`, written when both the attempt has
  ended and the instance row is ``terminated``/``abandoned``, by whichever of the two happens last, in its
  transaction: :func:`broker.service.lifecycle.record_usage` or :func:`broker.service.lifecycle.
  record_instance_usage`): the boot disk (``line="disk"``, from the create call to the deletion, stopped or
  not: :mod:`pricing.storage`) and the instance time no job used (``line="idle"``, unallocated: an
  instance the job never ran on, and the time from the attempt's end to the deletion, or to the stop the
  watch saw). Addresses: none bills (:mod:`pricing.storage` says why).

Prices: :func:`prices` gives the :class:`LedgerPrices` of this process: the one :func:`install`-ed (the live
wiring installs its planning environment's in every process that meters: the worker's planner and watch, and
the API's instance and node reports, :mod:`broker.service.wiring`), else one built on first use from the cluster file given to
:func:`configure` (default the bundled live cluster) and the bundled catalogs and grid signals.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from broker.model import CloudOffer, Pool
from broker.planner.costs import cloud_kw, load_emissions_kg, load_energy_kwh, onprem_cost
from broker.usage import GPU_HOUR_LINES, PRICING_UNITS, UsageRecord
from pricing.billing import billed_seconds
from pricing.errors import UnknownGpuTypeError
from pricing.power import DEFAULT_UTILISATION, gpu_power_w
from pricing.storage import BOOT_DISKS, disk_bill, disk_rate

__all__ = ["FILL_HOURS", "LAUNCH_PRICE", "LedgerPrices", "CloudPrice", "cloud_price", "origin_note", "signal_origin",
           "install", "configure", "prices", "snapshot_counters", "meter_attempt", "meter_instance_ends", "meter_pool_idle", "counterfactual_rates", "window_integral"]

#: a missing hour of a price or carbon series is filled from a neighbouring hour at most this many hours away
FILL_HOURS = 3
_H = 3600.0
#: counter readings come with the agents' heartbeats, not exactly at the run's start and end: the counter's mean
#: power is applied to the run, and the line is flagged an estimate when the readings' window differs from the
#: run by more than this share of the run (or :data:`_COUNTER_SLACK_S`, whichever is more)
_COUNTER_SLACK = 0.05
_COUNTER_SLACK_S = 1.0


@dataclass(frozen=True)
class LedgerPrices:
    """What the ledger prices with.

    Attributes:
        offers: cloud offers by ``offer_id`` (list USD/h, GPUs, PUE, carbon zone).
        pools: on-prem pools by name (price and carbon zones, PUE, amortised USD/GPU-h).
        signals_at: ``POSIX s -> signals`` whose ``carbon(zone)`` (gCO2e/kWh) and ``price(zone)`` (USD/MWh,
            ``None`` when the zone has none) are :class:`pricing.series.HourlySeries` on real UTC instants
            around that instant (the live broker replays the bundled history: :class:`broker.service.live.
            ReplayedSignals`).
        window_signals: ``(start POSIX s, end POSIX s, session or None) -> signals`` for metering a past window
            (the live environment's :meth:`~broker.service.live.LiveEnvironment.billing_signals`; the session: the
            metering transaction, for the cache's database reads); ``None``: ``signals_at`` of the start.
        cloud_cache: the :class:`broker.service.signal_cache.SignalCache` holding live cloud prices
            (``signals.cloud_prices`` configured), else ``None`` (instances bill at their launch price).
    """

    offers: Mapping[str, CloudOffer]
    pools: Mapping[str, Pool]
    signals_at: Callable[[float], Any]
    window_signals: Callable[[float, float, Any], Any] | None = None
    cloud_cache: Any = None

    def signals_for(self, start_s: float, end_s: float, s=None):
        """The signals to meter ``[start_s, end_s]`` (POSIX s) on (see ``window_signals``; ``s``: the open session
        of the metering transaction, or ``None``)."""
        if self.window_signals is not None:
            return self.window_signals(start_s, end_s, s)
        return self.signals_at(start_s)

    @classmethod
    def of(cls, offers: Iterable[CloudOffer], pools: Iterable[Pool], signals: Any) -> "LedgerPrices":
        """From offers, pools and one signals object (series on real instants)."""
        return cls({o.offer_id: o for o in offers}, {p.name: p for p in pools}, lambda _t: signals)

    @classmethod
    def from_environment(cls, env) -> "LedgerPrices":
        """From a :class:`broker.service.live.LiveEnvironment`: its (catalog) offers, its cluster file's pools, its
        replayed signals (the replay offset of the window's start), its live signals for metering a window
        (:meth:`~broker.service.live.LiveEnvironment.billing_signals`) and its live cloud price cache."""
        from broker.service.live import ReplayedSignals

        base, offset_for = env.base_signals, env.offset_for
        return cls({o.offer_id: o for o in env.offers}, dict(env.site_pools),
                   lambda t: ReplayedSignals(base, offset_for(t)), env.billing_signals, env.live_cloud_prices)


_lock = threading.Lock()
_installed: LedgerPrices | None = None
_cluster: Path | None = None
_builder: Callable[[], LedgerPrices] | None = None


def install(p: LedgerPrices | None) -> None:
    """Make ``p`` the ledger's prices in this process (``None``: build them again on next use)."""
    global _installed
    with _lock:
        _installed = p


def configure(cluster: str | Path | None, build: Callable[[], LedgerPrices] | None = None) -> None:
    """The cluster file the lazily built prices read (``None``: the bundled live cluster); forgets built ones.
    ``build``: a zero-argument function giving the prices instead, on first use (the live wiring's:
    :meth:`broker.service.wiring.Services.ledger_prices`, its planning environment's offers, pools, live
    signals and cloud price cache), so every process that meters prices as the planner does."""
    global _cluster, _installed, _builder
    with _lock:
        if (Path(cluster) if cluster else None) != _cluster or build != _builder:
            _cluster, _installed, _builder = (Path(cluster) if cluster else None), None, build


def prices() -> LedgerPrices:
    """This process's :class:`LedgerPrices` (see the module docstring)."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        build, cluster = _builder, _cluster
    # built outside the lock: the wiring's builder takes its own lock and installs (no lock-order deadlock)
    if build is not None:
        got = build()
    else:
        from broker.planner.core import PlannerConfig
        from broker.service.live import LiveEnvironment

        got = LedgerPrices.from_environment(LiveEnvironment(PlannerConfig(), cluster))
    with _lock:
        if _installed is None:
            _installed = got
        return _installed


# ----------------------------------------------------------------------------- signals
def _hour(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def _hours_of(start_s: float, end_s: float) -> list[float]:
    """The UTC hour starts (POSIX s) of the hours ``[start_s, end_s)`` touches (the start's hour when empty)."""
    h = math.floor(start_s / _H) * _H
    out = [h]
    while h + _H < end_s:
        h += _H
        out.append(h)
    return out


def origin_note(what: str, origins: list[str], good: list[bool], good_word: str) -> tuple[str, list[str]]:
    """``(price_source label, reasons)`` of a line priced on hours of ``origins`` (one per hour; ``good[i]``:
    hour ``i``'s value is the measured or live one): the label is the distinct origins joined by ``+`` in
    order of first use; one reason when some hour is not ``good_word``, naming the count per origin."""
    label = "+".join(dict.fromkeys(origins))
    bad = [o for o, g in zip(origins, good) if not g]
    if not bad:
        return label, []
    counts = {o: bad.count(o) for o in dict.fromkeys(bad)}
    return label, [f"{what}: {len(bad)} of {len(origins)} h not {good_word} ("
                   + ", ".join(f"{o} {c} h" for o, c in counts.items()) + ")"]


def signal_origin(sig, zone: str, kind: str, start_s: float, end_s: float, what: str) -> tuple[str, list[str]]:
    """Where the ``kind`` (``"carbon"``/``"price"``) hours of ``zone`` over ``[start_s, end_s]`` (POSIX s) came
    from in ``sig`` and why they are estimates: :func:`origin_note` of the per-hour origins a
    :class:`broker.service.live.LiveSignals` keeps (an hour is measured when its origin is one of the zone's
    configured sources, not a forecast, not flagged estimated by the source; hours outside its window are the
    bundled replay). A zone with no live source, or replayed signals: ``("bundled-replay", [])`` (the bundled
    history, metered as before live signals existed)."""
    from broker.service.live import REPLAY, LiveSignals

    net = sig.network_sources(zone, kind) if isinstance(sig, LiveSignals) else []
    if not net:
        return REPLAY, []
    checked, fc, _fetched = sig.checked(zone, kind)
    origins, good = [], []
    for t in _hours_of(start_s, end_s):
        i = int(round((t - sig.start_s) / _H))
        if 0 <= i < checked.series.values.size:
            org = str(checked.origin[i]) or "missing"
            origins.append(org)
            good.append(org in net and not bool(fc[i]) and not bool(checked.estimated[i]))
        else:
            origins.append(REPLAY)
            good.append(False)
    return origin_note(f"{what} {zone}", origins, good, "measured")


def window_integral(series, start_s: float, end_s: float, what: str) -> tuple[float | None, list[str]]:
    """``∫ value dt`` of ``series`` over ``[start_s, end_s]`` (POSIX s), in its unit x hours, and the reasons
    it is an estimate. A missing interval is filled with the nearest present value within
    :data:`FILL_HOURS` intervals (the mean of the two neighbours when both are as near; flagged). ``None``
    with the reason when ``series`` is ``None``, the window leaves the series, or a gap is wider."""
    if series is None:
        return None, [f"no {what} series"]
    if end_s <= start_s:
        return 0.0, []
    v = series.integral(start_s, end_s)
    if math.isfinite(v):
        return v, []
    if start_s < series.start_s or end_s > series.end_s:
        return None, [f"no {what} for {_hour(start_s)}..{_hour(end_s)}: outside the {series.zone} series"]
    iv, vals = series.interval_s, series.values
    i0, i1 = int((start_s - series.start_s) // iv), int(math.ceil((end_s - series.start_s) / iv))
    total, filled = 0.0, []
    for i in range(i0, min(i1, vals.size)):
        a = max(start_s, series.start_s + i * iv)
        b = min(end_s, series.start_s + (i + 1) * iv)
        x = float(vals[i])
        if math.isnan(x):
            for d in range(1, FILL_HOURS + 1):
                near = [float(vals[k]) for k in (i - d, i + d) if 0 <= k < vals.size and not math.isnan(vals[k])]
                if near:
                    x = sum(near) / len(near)
                    break
            else:
                return None, [f"no {what} for {_hour(a)} in {series.zone} (no value within {FILL_HOURS} h)"]
            filled.append(_hour(a))
        total += x * (b - a) / _H
    return total, [f"{what} interpolated for {', '.join(filled)} in {series.zone}"] if filled else []


# ----------------------------------------------------------------------------- cloud prices
#: ``price_source`` of an instance hour priced at the USD/h recorded on its row at the create call
LAUNCH_PRICE = "launch-price"


@dataclass(frozen=True)
class CloudPrice:
    """The USD/h of one cloud instance in each UTC hour from its create call: what its bill is worked from.

    Attributes:
        created_s: the create call, POSIX s (billing starts there).
        h0: POSIX s of the first hour (``created_s``'s UTC hour).
        usd_h: USD/h per hour from ``h0``; origins: each hour's ``price_source``; live: whether each hour's
            price is the live one in force (else a stand-in, flagged).
    """

    created_s: float
    h0: float
    usd_h: tuple[float, ...]
    origins: tuple[str, ...]
    live: tuple[bool, ...]

    def bill(self, billed_s: float) -> float:
        """USD of ``billed_s`` billed seconds counted from the create call (:func:`pricing.billing.billed_seconds`
        decides them: per second, 60-s minimum), each second at the price of the UTC hour it falls in. Raises
        ``ValueError`` naming ``billed_s`` when the schedule does not reach that far."""
        if billed_s > self.h0 + len(self.usd_h) * _H - self.created_s + 1e-6:
            raise ValueError(f"billed_s={billed_s!r}: past the {len(self.usd_h)} priced hour(s)")
        total = 0.0
        for k, usd in enumerate(self.usd_h):  # seconds from the create call (exact: no large POSIX sums)
            lo = max(0.0, self.h0 + k * _H - self.created_s)
            hi = min(billed_s, self.h0 + (k + 1) * _H - self.created_s)
            if hi > lo:
                total += usd * (hi - lo) / _H
        return total

    def unit_price(self, from_s: float, to_s: float, usd: float, billed_s: float) -> float:
        """The line's list USD/h over ``[from_s, to_s)`` (POSIX s): the hours' price when they share one, else the
        billed-seconds-weighted mean ``usd / billed hours``."""
        ks = {int(round((t - self.h0) / _H)) for t in _hours_of(from_s, to_s)}
        distinct = {self.usd_h[k] for k in ks if 0 <= k < len(self.usd_h)}
        if len(distinct) == 1 or billed_s <= 0:
            return next(iter(distinct)) if distinct else self.usd_h[0]
        return usd / (billed_s / _H)

    def note(self, from_s: float, to_s: float) -> tuple[str, list[str]]:
        """``(price_source, reasons)`` of the hours ``[from_s, to_s)`` (POSIX s) touch (:func:`origin_note`)."""
        ks = [int(round((t - self.h0) / _H)) for t in _hours_of(from_s, to_s)]
        ks = [k for k in ks if 0 <= k < len(self.usd_h)]
        return origin_note("compute price", [self.origins[k] for k in ks], [self.live[k] for k in ks],
                           "the live price in force")


def cloud_price(p: LedgerPrices, row, offer: CloudOffer, until_s: float, s=None) -> CloudPrice:
    """The :class:`CloudPrice` of instance ``row`` (a ``cloud_instances`` row of catalog offer ``offer``) from its
    create call to ``until_s`` (POSIX s): per UTC hour, spot: the live cache's hourly price of the offer for that
    hour; on-demand: the live list price cached at the create call (the latest cached hour at or before it,
    :meth:`broker.service.signal_cache.SignalCache.cloud_prices`); else the row's ``launch_usd_per_hour``
    (:data:`LAUNCH_PRICE`; a stand-in, flagged, when the offer's region has live prices configured); else the
    bundled catalog's ``usd_per_hour`` (flagged). A live value that is not finite and > 0 counts as none. ``s``:
    the open session of the metering transaction (the cache's database reads run in it), or ``None``."""
    from pricing.cloud_price_sources import BUNDLED_CATALOG, live_source_for
    from pricing.offers import Market

    created = row.created_at.timestamp()
    hours = _hours_of(created, max(until_s, created))
    n = len(hours)
    live_vals: list[float | None] = [None] * n
    live_src = live_source_for(offer)
    live_est = [False] * n
    cache = p.cloud_cache
    configured = cache is not None and offer.region in cache.settings.cloud_prices.regions(offer.provider)
    if configured and s is not None:
        cache = cache.in_session(s)
    if configured:
        if offer.market is Market.spot:
            h = cache.hours(live_src, offer.offer_id, hours[0], n)
            for k in range(n):
                v = float(h.values[k])
                if math.isfinite(v) and v > 0:
                    live_vals[k], live_est[k] = v, bool(h.estimated[k])
        else:
            got = cache.cloud_prices([offer], created).prices.get(offer.offer_id)
            if got is not None and math.isfinite(got[0].usd_per_hour) and got[0].usd_per_hour > 0:
                live_vals = [got[0].usd_per_hour] * n
                live_est = [got[1]] * n
    usd, origins, ok = [], [], []
    for k in range(n):
        if live_vals[k] is not None:
            usd.append(live_vals[k]), origins.append(live_src), ok.append(not live_est[k])
        elif row.launch_usd_per_hour is not None:
            usd.append(float(row.launch_usd_per_hour)), origins.append(LAUNCH_PRICE), ok.append(not configured)
        else:
            usd.append(offer.usd_per_hour), origins.append(BUNDLED_CATALOG), ok.append(False)
    return CloudPrice(created, hours[0], tuple(usd), tuple(origins), tuple(ok))


# ----------------------------------------------------------------------------- energy counters
def snapshot_counters(s, att, at: datetime) -> None:
    """Inside ``s``: keep on on-prem attempt ``att`` (``att.meter["start"]``) the energy counters and power
    samples its nodes last reported (each node's last heartbeat, with its instant): the start readings of
    the attempt's energy line. Called when the attempt starts running; does nothing for a cloud attempt or
    when the readings are already kept."""
    from broker.service.store.tables import Node

    if att is None or att.kind != "onprem" or (att.meter or {}).get("start"):
        return
    start: dict[str, Any] = {}
    for part in att.nodes or []:
        n = s.get(Node, part.get("node"))
        if n is None:
            continue
        start[n.name] = _reading(n, part.get("gpus", []))
    att.meter = {**(att.meter or {}), "start": start}


def _reading(node, gpus: Iterable[int]) -> dict:
    tel = {g.get("index"): g for g in ((node.telemetry or {}).get("gpus") or [])}
    return {"at": node.last_heartbeat_at.isoformat(),
            "gpus": {str(i): {"energy_mj": (tel.get(i) or {}).get("energy_mj"),
                              "power_w": (tel.get(i) or {}).get("power_w")} for i in gpus}}


def _rank_power_kw(start_rd: dict | None, end_rd: dict | None, gpus: list[int], gpu_type: str,
                   run_s: float) -> tuple[float, list[str]]:
    """Mean IT power of a rank's GPUs over its window, kW, and the reasons it is an estimate: from the
    energy counters, else sampled power, else the modelled power of ``gpu_type``."""
    kw, reasons, modelled = 0.0, [], []
    t0 = datetime.fromisoformat(start_rd["at"]).timestamp() if start_rd else None
    t1 = datetime.fromisoformat(end_rd["at"]).timestamp() if end_rd else None
    for g in gpus:
        a = ((start_rd or {}).get("gpus") or {}).get(str(g)) or {}
        b = ((end_rd or {}).get("gpus") or {}).get(str(g)) or {}
        ea, eb = a.get("energy_mj"), b.get("energy_mj")
        if ea is not None and eb is not None and t0 is not None and t1 is not None and t1 > t0 and eb >= ea:
            kw += (eb - ea) / 1000.0 / (t1 - t0) / 1000.0  # mJ -> J, / s -> W, -> kW
            if abs((t1 - t0) - run_s) > max(_COUNTER_SLACK_S, _COUNTER_SLACK * run_s):
                reasons.append(f"GPU {g}: counter read over {t1 - t0:.0f} s of the {run_s:.0f}-s run; "
                               "scaled to the run")
            continue
        pa, pb = a.get("power_w"), b.get("power_w")
        samples = [p for p in (pa, pb) if p is not None]
        if samples:
            kw += sum(samples) / len(samples) / 1000.0
            why = ("counter went backwards (driver reloaded?)" if ea is not None and eb is not None and eb < ea
                   else "no energy counter")
            reasons.append(f"GPU {g}: {why}; mean of {len(samples)} power sample(s)")
            continue
        kw += gpu_power_w(gpu_type) / 1000.0
        modelled.append(str(g))
    if modelled:
        reasons.append(f"GPU(s) {', '.join(modelled)}: no counter or power sample; modelled {gpu_type} power")
    return kw, reasons


# ----------------------------------------------------------------------------- metering
def meter_attempt(s, att, job, now: datetime, p: LedgerPrices) -> list[UsageRecord]:
    """Inside ``s``: the usage records of ended attempt ``att`` of ``job`` (``att.ended_at`` set; ``now`` its
    end, UTC). Reads the attempt's cloud instance rows or its nodes' last readings; writes nothing."""
    end = att.ended_at or now
    base = dict(job_id=att.job_id, attempt=att.number, team=job.team if job is not None else "",
                project=((job.spec or {}).get("project") if job is not None else None))
    if att.kind == "cloud":
        return _meter_cloud(s, att, end, base, p)
    if att.kind != "onprem":
        return _meter_scheduler(s, att, end, base, p)
    return _meter_onprem(s, att, end, base, p)


def _unreported(att, rank: int) -> list[str]:
    code = (att.rank_exits or {}).get(str(rank))
    if code is None or code == "lost":
        return [f"rank {rank} never reported its end; metered to the attempt's end"]
    return []


def _window(start: datetime, end: datetime) -> tuple[datetime, float, list[str]]:
    if end < start:  # clocks disagree: flagged, metered as nothing rather than a negative time
        return start, 0.0, [f"end {end.isoformat()} before start {start.isoformat()}; metered 0 s"]
    return end, (end - start).total_seconds(), []


def _used(att, row) -> bool:
    """Whether the job ran on ``row``'s instance: the attempt ran, and its placement names the instance (a gang
    member created on an option the attempt then gave up is not in it)."""
    return att.started_at is not None and row.provider_instance_id in {
        part.get("instance_id") for part in (att.nodes or [])}


def _gpus(att, offer) -> tuple[str, int]:
    gpu_type = offer.gpu_type if offer else (att.gpu_type or "unknown")
    ranks = max(1, len(att.nodes or []))
    return gpu_type, (offer.gpu_count if offer else max(1, att.gpus // ranks))  # unknown offer: the attempt's share


def _instance_line(s, att, row, line: str, start: datetime, stop: datetime, usd_of: Callable[[CloudPrice], float],
                   billed: float, base: dict, p: LedgerPrices, why: list[str], billed_from_s: float = 0.0
                   ) -> UsageRecord:
    """An ``instance`` or ``idle`` line of ``row`` over ``[start, stop]``: ``billed`` seconds, the ``billed_from_s``
    seconds after the create call onwards (an idle line after the job's), ``usd_of(the instance's CloudPrice)``
    USD; modelled power: every GPU busy on an ``instance`` line, idle on an ``idle`` one."""
    offer = p.offers.get(row.offer_id)
    run_s = (stop - start).total_seconds()
    gpu_type, gpu_count = _gpus(att, offer)
    source = None
    if offer is None:
        usd = energy = carbon = price = None
        why.append(f"offer {row.offer_id!r} not in the price catalog: no price, power or carbon zone")
    else:
        created = row.created_at.timestamp()
        a, b = created + billed_from_s, created + billed_from_s + billed
        sched = cloud_price(p, row, offer, b, s)
        usd = float(usd_of(sched))
        price = sched.unit_price(a, b, usd, billed)
        source, pwhy = sched.note(a, b)
        w = gpu_power_w(offer.gpu_type, 0.0 if line == "idle" else DEFAULT_UTILISATION) / 1000.0
        kw = cloud_kw(1, offer.gpu_count, offer.gpu_count, w, w, offer.pue)
        energy = float(load_energy_kwh(kw, run_s))
        how = "idle" if line == "idle" else "at the default utilisation"
        why.append(f"power modelled ({offer.gpu_count} x {offer.gpu_type} {how} x PUE {offer.pue}): cloud "
                   "instances give no energy counter")
        t0, t1 = start.timestamp(), stop.timestamp()
        sig = p.signals_for(t0, t1, s)
        ci, cwhy = window_integral(_carbon(sig, offer.carbon_zone), t0, t1, "carbon intensity")
        carbon = None if ci is None else float(load_emissions_kg(kw, ci))
        why += cwhy + signal_origin(sig, offer.carbon_zone, "carbon", t0, t1, "carbon intensity")[1] + pwhy
    return UsageRecord(**base, rank=row.rank, line=line, resource=row.provider_instance_id, start=start, end=stop,
                       provider=row.provider, region=row.region, zone=row.zone, instance_type=row.instance_type,
                       market=row.market, gpu_type=gpu_type, gpu_count=gpu_count, run_s=run_s, billed_s=billed,
                       list_unit_price_usd=price, billed_usd=usd, energy_kwh=energy, carbon_kg=carbon,
                       estimated=bool(why), estimate_reasons=tuple(why), price_source=source)


def _meter_cloud(s, att, end: datetime, base: dict, p: LedgerPrices) -> list[UsageRecord]:
    from broker.service.store import usage as repo

    out = []
    for row in repo.billed_instances(s, att.job_id, att.number):
        if not _used(att, row):
            continue  # all idle: metered once its instance is deleted (:func:`meter_instance_ends`)
        stop = min(t for t in (end, repo.deleted_at(s, row), _stopped_at(att, row)) if t is not None)
        stop, run_s, why = _window(row.created_at, stop)
        why += _unreported(att, row.rank)
        billed = billed_seconds(row.provider, run_s)
        out.append(_instance_line(s, att, row, "instance", row.created_at, stop, lambda cp: cp.bill(billed), billed, base,
                                  p, why))
    return out + meter_instance_ends(s, att, None, p, base)


def _stopped_at(att, row) -> datetime | None:
    """When the provider reported ``row``'s instance stopped (:func:`broker.service.lifecycle.note_instance_stopped`)."""
    at = ((att.meter or {}).get("stopped") or {}).get(row.provider_instance_id)
    return datetime.fromisoformat(at) if at else None


def meter_instance_ends(s, att, job, p: LedgerPrices, base: dict | None = None) -> list[UsageRecord]:
    """Inside ``s``: the lines of ended attempt ``att``'s cloud instances that are deleted (their rows
    ``terminated`` or ``abandoned``), which only their deletion decides; writes nothing, and returns nothing
    before the attempt ends.

    * ``disk``: the boot disk (:data:`pricing.storage.BOOT_DISKS`) from the create call to the deletion (it is
      deleted with its instance; stopped or not, it bills), priced by :func:`pricing.storage.disk_bill`;
      flagged when the instance's region is not the one the disk price is the list price of. Energy and
      carbon 0: the ledger models GPU power only (no host, memory or storage power, as on instance lines).
    * ``idle`` (unallocated): the instance time no job used, at the instance's list price: the whole window of
      an instance the job never ran on (the attempt never started, or a gang member of an option given up), and
      for one it ran on, the time from the attempt's end to the deletion (a terminate call that failed and was
      retried, a stopped instance not yet deleted), priced as the difference ``bill(create..deletion) -
      bill(create..attempt end)`` so the job line and the idle line add up to the instance's bill exactly
      (the 60-s minimum stays with the job line). Modelled power: the GPUs idle. An instance the provider
      reported stopped (:func:`broker.service.lifecycle.note_instance_stopped`) bills no compute from then on:
      its job and idle lines end at the stop, its disk line still runs to the deletion.
    """
    from broker.service.store import usage as repo

    if att.ended_at is None or att.kind != "cloud":
        return []
    if base is None:
        base = dict(job_id=att.job_id, attempt=att.number, team=job.team if job is not None else "",
                    project=((job.spec or {}).get("project") if job is not None else None))
    end = att.ended_at
    out = []
    for row in repo.billed_instances(s, att.job_id, att.number):
        deleted = repo.deleted_at(s, row)
        if deleted is None:
            continue
        deleted, life_s, why = _window(row.created_at, deleted)
        out.append(_disk_line(att, row, deleted, life_s, base, p, list(why)))
        stopped = _stopped_at(att, row)
        busy_to = max(row.created_at, min(deleted, stopped)) if stopped is not None else deleted
        busy_s = (busy_to - row.created_at).total_seconds()
        if not _used(att, row):
            billed = billed_seconds(row.provider, busy_s)
            out.append(_instance_line(s, att, row, "idle", row.created_at, busy_to, lambda cp: cp.bill(billed), billed,
                                      base, p, why))
        elif busy_to > end:
            job_s = max(0.0, (end - row.created_at).total_seconds())
            b_all, b_job = billed_seconds(row.provider, busy_s), billed_seconds(row.provider, job_s)
            out.append(_instance_line(s, att, row, "idle", max(end, row.created_at), busy_to,
                                      lambda cp: cp.bill(b_all) - cp.bill(b_job), b_all - b_job, base, p, why,
                                      billed_from_s=b_job))
    return out


def _disk_line(att, row, deleted: datetime, life_s: float, base: dict, p: LedgerPrices,
               why: list[str]) -> UsageRecord:
    offer = p.offers.get(row.offer_id)
    gpu_type, _ = _gpus(att, offer)
    disk = BOOT_DISKS.get(row.provider)
    if disk is None:
        why.append(f"provider {row.provider!r}: no boot disk or disk price known")
        price = usd = None
        billed = life_s
    else:
        rate = disk_rate(row.provider)
        bill = disk_bill(row.provider, disk.size_gb, row.created_at, deleted)
        price, usd, billed = rate.usd_per_gb_month, bill.usd, bill.billed_s
        if row.region != rate.priced_region:
            why.append(f"{disk.size_gb:g} GB {rate.disk_type} priced at the {rate.priced_region} list price "
                       f"({rate.usd_per_gb_month} USD/GB-month); {row.region}'s may differ")
    return UsageRecord(**base, rank=row.rank, line="disk", resource=row.provider_instance_id, start=row.created_at,
                       end=deleted, provider=row.provider, region=row.region, zone=row.zone,
                       instance_type=row.instance_type, market=row.market, gpu_type=gpu_type, gpu_count=0,
                       run_s=life_s, billed_s=billed, list_unit_price_usd=price, pricing_unit=PRICING_UNITS["disk"],
                       billed_usd=usd, energy_kwh=0.0, carbon_kg=0.0, estimated=bool(why), estimate_reasons=tuple(why))


def _carbon(sig, zone: str):
    """``sig``'s carbon series of ``zone`` (gCO2e/kWh), ``None`` for a zone it does not hold."""
    try:
        return sig.carbon(zone)
    except ValueError:
        return None


def _price(sig, zone: str):
    """``sig``'s electricity price series of ``zone`` (USD/MWh), ``None`` when it has none."""
    try:
        return sig.price(zone)
    except ValueError:
        return None


def _meter_onprem(s, att, end: datetime, base: dict, p: LedgerPrices) -> list[UsageRecord]:
    from broker.service.store.tables import Node

    if att.started_at is None:  # nothing ran: the held GPUs are idle time (a later line)
        return []
    pool = p.pools.get(att.pool or "")
    sig = (p.signals_for(att.started_at.timestamp(), max(end, att.started_at).timestamp(), s) if pool is not None
           else None)
    out = []
    for part in att.nodes or []:
        rank, node, gpus = int(part.get("rank", 0)), part.get("node", ""), list(part.get("gpus", []))
        stop, run_s, clock = _window(att.started_at, end)
        why = clock + _unreported(att, rank)
        n = s.get(Node, node)
        start_rd = ((att.meter or {}).get("start") or {}).get(node)
        end_rd = _reading(n, gpus) if n is not None else None
        gpu_type = att.gpu_type or (n.gpu_type if n is not None else "unknown")
        it_kw, pwhy = _rank_power_kw(start_rd, end_rd, gpus, gpu_type, run_s)
        why += pwhy
        common = dict(base, rank=rank, resource=node, start=att.started_at, end=stop, provider="onprem",
                      pool=att.pool, gpu_type=gpu_type, gpu_count=len(gpus), run_s=run_s, billed_s=run_s)
        if pool is None:
            why.append(f"pool {att.pool!r} not in the cluster file: no PUE, tariff, carbon zone or $/GPU-h")
            for line in ("energy", "amortised"):
                out.append(UsageRecord(**common, line=line, pricing_unit=PRICING_UNITS[line],
                                       list_unit_price_usd=None, billed_usd=None,
                                       energy_kwh=None if line == "energy" else 0.0,
                                       carbon_kg=None if line == "energy" else 0.0,
                                       estimated=True, estimate_reasons=tuple(why)))
            continue
        kw = it_kw * pool.pue
        t0, t1 = att.started_at.timestamp(), stop.timestamp()
        tariff, twhy = window_integral(_price(sig, pool.price_zone), t0, t1, "electricity price")
        ci, cwhy = window_integral(_carbon(sig, pool.carbon_zone), t0, t1, "carbon intensity")
        source, owhy = signal_origin(sig, pool.price_zone, "price", t0, t1, "electricity price")
        cwhy = cwhy + signal_origin(sig, pool.carbon_zone, "carbon", t0, t1, "carbon intensity")[1]
        twhy = twhy + owhy
        c = onprem_cost(run_s, gpus=len(gpus), kw=kw, usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour,
                        tariff_integral=tariff if tariff is not None else math.nan,
                        carbon_integral=ci if ci is not None else math.nan)
        ewhy = why + twhy + cwhy
        mean_tariff = (tariff / (run_s / _H) / 1000.0) if tariff is not None and run_s > 0 else None
        out.append(UsageRecord(**common, line="energy", pricing_unit=PRICING_UNITS["energy"],
                               region=pool.price_zone, list_unit_price_usd=mean_tariff,
                               billed_usd=None if tariff is None else float(c.energy_usd),
                               energy_kwh=float(c.energy_kwh), carbon_kg=None if ci is None else float(c.carbon_kg),
                               estimated=bool(ewhy), estimate_reasons=tuple(ewhy),
                               price_source=source if tariff is not None else None))
        awhy = clock + _unreported(att, rank)
        out.append(UsageRecord(**common, line="amortised", pricing_unit=PRICING_UNITS["amortised"],
                               region=pool.price_zone,
                               list_unit_price_usd=pool.amortised_usd_per_gpu_hour,
                               billed_usd=float(c.amortised_usd), energy_kwh=0.0, carbon_kg=0.0,
                               estimated=bool(awhy), estimate_reasons=tuple(awhy)))
    return out


def _meter_scheduler(s, att, end: datetime, base: dict, p: LedgerPrices) -> list[UsageRecord]:
    """The ``energy`` and ``amortised`` lines of an attempt run by an existing scheduler (the module docstring)."""
    if att.started_at is None:  # it never left the scheduler's queue: nothing ran
        return []
    m = (att.meter or {}).get("scheduler") or {}
    stop, run_s, why = _window(att.started_at, end)
    if isinstance(m.get("elapsed_s"), (int, float)) and m["elapsed_s"] >= 0:
        run_s = float(m["elapsed_s"])  # the scheduler's own clock of the run
    else:
        why.append("no elapsed time from the scheduler; metered from the attempt's start to its end")
    gpu_type = att.gpu_type or "unknown"
    pool = p.pools.get(att.pool or "")
    common = dict(base, rank=0, resource=f"{att.kind}:{att.external_id or '?'}", start=att.started_at, end=stop,
                  provider="onprem", pool=att.pool, gpu_type=gpu_type, gpu_count=int(att.gpus), run_s=run_s,
                  billed_s=run_s)
    if pool is None:
        why.append(f"pool {att.pool!r} not in the cluster file: no PUE, tariff, carbon zone or $/GPU-h")
        return [UsageRecord(**common, line=line, pricing_unit=PRICING_UNITS[line], list_unit_price_usd=None,
                            billed_usd=None, energy_kwh=None if line == "energy" else 0.0,
                            carbon_kg=None if line == "energy" else 0.0, estimated=True, estimate_reasons=tuple(why))
                for line in ("energy", "amortised")]
    joules = m.get("consumed_energy_j")
    ewhy = list(why)
    if isinstance(joules, (int, float)) and joules > 0 and run_s > 0:
        it_kw = joules / run_s / 1000.0  # J / s -> W -> kW, the nodes' mean power as the scheduler accounted it
    else:
        try:
            it_kw = int(att.gpus) * gpu_power_w(gpu_type) / 1000.0
            ewhy.append(f"the scheduler accounted no energy (ConsumedEnergy); modelled {att.gpus} x {gpu_type} power")
        except ValueError:
            it_kw = math.nan
            ewhy.append(f"the scheduler accounted no energy and {gpu_type!r} has no power model")
    t0, t1 = att.started_at.timestamp(), att.started_at.timestamp() + run_s
    sig = p.signals_for(t0, t1, s)  # the signals the live planner used (as for agent attempts)
    tariff, twhy = window_integral(_price(sig, pool.price_zone), t0, t1, "electricity price")
    ci, cwhy = window_integral(_carbon(sig, pool.carbon_zone), t0, t1, "carbon intensity")
    source, owhy = signal_origin(sig, pool.price_zone, "price", t0, t1, "electricity price")
    twhy = twhy + owhy
    cwhy = cwhy + signal_origin(sig, pool.carbon_zone, "carbon", t0, t1, "carbon intensity")[1]
    c = onprem_cost(run_s, gpus=int(att.gpus), kw=it_kw * pool.pue, usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour,
                    tariff_integral=tariff if tariff is not None else math.nan,
                    carbon_integral=ci if ci is not None else math.nan)
    ewhy += twhy + cwhy
    known = math.isfinite(it_kw)
    mean_tariff = (tariff / (run_s / _H) / 1000.0) if tariff is not None and run_s > 0 else None
    return [UsageRecord(**common, line="energy", pricing_unit=PRICING_UNITS["energy"], region=pool.price_zone,
                        list_unit_price_usd=mean_tariff,
                        billed_usd=float(c.energy_usd) if tariff is not None and known else None,
                        energy_kwh=float(c.energy_kwh) if known else None,
                        carbon_kg=float(c.carbon_kg) if ci is not None and known else None,
                        estimated=bool(ewhy), estimate_reasons=tuple(ewhy),
                        price_source=source if tariff is not None else None),
            UsageRecord(**common, line="amortised", pricing_unit=PRICING_UNITS["amortised"], region=pool.price_zone,
                        list_unit_price_usd=pool.amortised_usd_per_gpu_hour, billed_usd=float(c.amortised_usd),
                        energy_kwh=0.0, carbon_kg=0.0, estimated=bool(why), estimate_reasons=tuple(why))]


# ----------------------------------------------------------------------------- idle on-prem GPUs
def meter_pool_idle(s, start: datetime, end: datetime, p: LedgerPrices) -> list[UsageRecord]:
    """Inside ``s``: the ``idle_amortised`` lines (unallocated) of ``[start, end)`` (UTC; a closed period, in
    practice one hour): per registered on-prem node, the GPU-seconds of the period no running attempt held, at
    its pool's amortised USD per GPU-hour. Writes nothing.

    A node's capacity is its GPUs (as registered) x the part of the period since it registered; an attempt
    holds its GPUs on the node from its start to its end (its ``amortised`` line's window: an attempt that
    never started holds nothing, its GPUs are idle). So over any period whose edges no attempt crosses,
    ``amortised lines + idle_amortised lines = GPUs x hours x USD/GPU-h`` of the pool, exactly. One line per
    node with idle GPUs (``gpu_count``: the node's GPUs; ``run_s``/``billed_s``: idle GPU-seconds / GPUs, so
    GPU-hours = ``gpu_count x billed_s / 3600``); ``job_id``/``team`` empty, ``attempt``/``rank`` 0; energy and
    carbon 0 (an idle GPU's draw is in the facility meter, against which :func:`broker.service.reconcile.
    reconcile_energy` sets the ledger's energy lines). A node of a pool not in the cluster file gets a line of
    unknown cost, flagged."""
    from broker.service.store import usage as repo

    if end <= start:
        raise ValueError(f"end={end.isoformat()!r}: not after start={start.isoformat()!r}")
    held: dict[str, float] = {}
    for _pool, a, b, parts in repo.ran_onprem(s, start, end):
        lo, hi = max(a, start), min(b or end, end)
        if hi <= lo:
            continue
        for part in parts:
            held[part.get("node", "")] = held.get(part.get("node", ""), 0.0) + len(part.get("gpus", [])) * (
                hi - lo).total_seconds()
    out = []
    for name, pool_name, gpu_type, gpus, registered in repo.registered_nodes(s, end):
        span = (end - max(start, registered)).total_seconds()
        idle_gpu_s = gpus * span - held.get(name, 0.0)
        if gpus <= 0 or idle_gpu_s <= 1e-6:
            continue
        pool = p.pools.get(pool_name)
        seconds = idle_gpu_s / gpus
        why = [] if pool is not None else [f"pool {pool_name!r} not in the cluster file: no $/GPU-h"]
        rate = pool.amortised_usd_per_gpu_hour if pool is not None else None
        out.append(UsageRecord(job_id="", attempt=0, rank=0, line="idle_amortised", resource=name, team="",
                               start=max(start, registered), end=end, provider="onprem",
                               region=pool.price_zone if pool else None, pool=pool_name, gpu_type=gpu_type,
                               gpu_count=gpus, run_s=seconds, billed_s=seconds,
                               pricing_unit=PRICING_UNITS["idle_amortised"], list_unit_price_usd=rate,
                               billed_usd=None if rate is None else rate * idle_gpu_s / _H, energy_kwh=0.0,
                               carbon_kg=0.0, estimated=bool(why), estimate_reasons=tuple(why)))
    return out


# ----------------------------------------------------------------------------- counterfactuals
def counterfactual_rates(p: LedgerPrices, records: Iterable[UsageRecord], start: datetime, end: datetime,
                         live_nodes: Iterable[tuple[str, str]] = ()) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """The USD per GPU-hour :func:`broker.usage.savings` prices the counterfactuals at, for each GPU type of
    ``records`` (the period ``[start, end)``, UTC), and how each was found. Returns ``(cloud, onprem, notes)``.

    * **all on the cheapest cloud now**: the lowest ``usd_per_hour / gpu_count`` of the price catalog's offers
      of that type, any provider, region and market (spot included: its price now, not its interruptions);
      billing minimums and boot time left out, so the figure is a floor.
    * **on-prem only**: the lowest amortised USD per GPU-hour of a pool that has that type, plus the
      energy USD per GPU-hour: the ledger's own energy lines of that type in the records (their USD / their
      GPU-hours); with none, the modelled power of the type (:func:`pricing.power.gpu_power_w`) x the pool's PUE
      x the pool zone's mean tariff over the period. The pools' capacity is not a limit here (the simulator's
      runs show the queueing an on-prem-only placement would add). A pool of the cluster file, of any kind
      (agent, Slurm, Kubernetes), *has* a type when its cluster-file nodes list it, when one of ``records``'
      on-prem lines ran that type on it (a scheduler pool's nodes come from its cluster, not the file), or when
      ``live_nodes`` (``(pool, GPU type)`` of the registered agent nodes) list it (a live H200 in a pool whose
      file says V100).

    A type with no offer, or no pool, or no tariff, has no rate on that side (its work is left out and
    counted by :func:`broker.usage.savings`)."""
    from pricing.power import canonical_or_same

    records = list(records)
    types = sorted({r.gpu_type for r in records if r.line in GPU_HOUR_LINES})
    has: dict[str, set[str]] = {pl.name: {canonical_or_same(n.gpu_type) for n in pl.nodes} for pl in p.pools.values()}
    seen = [(r.pool, r.gpu_type) for r in records if r.provider == "onprem" and r.pool]
    for pool_name, gpu_type in [*seen, *live_nodes]:
        if pool_name in has:
            has[pool_name].add(canonical_or_same(gpu_type))
    cloud: dict[str, float] = {}
    onprem: dict[str, float] = {}
    notes: list[str] = []
    for t in types:
        ct = canonical_or_same(t)
        offers = [o for o in p.offers.values() if o.gpu_count > 0 and canonical_or_same(o.gpu_type) == ct]
        if offers:
            best = min(offers, key=lambda o: (o.usd_per_hour / o.gpu_count, o.offer_id))
            cloud[t] = best.usd_per_hour / best.gpu_count
            notes.append(f"{t} cloud: {cloud[t]:.4f} USD/GPU-h, {best.offer_id} ({best.usd_per_hour} USD/h, "
                         f"{best.gpu_count} GPU)")
        else:
            notes.append(f"{t} cloud: no offer of this type in the price catalog")
        pools = [pl for pl in p.pools.values() if ct in has[pl.name]]
        if not pools:
            notes.append(f"{t} on-prem: no pool of the cluster file has this type (in its nodes, the ledger or the "
                         f"live nodes)")
            continue
        pool = min(pools, key=lambda pl: (pl.amortised_usd_per_gpu_hour, pl.name))
        used = [r for r in records if r.line == "energy" and r.gpu_type == t and r.billed_usd is not None]
        gh = sum(r.gpu_hours for r in used)
        if gh > 0:
            energy = math.fsum(r.billed_usd for r in used) / gh
            how = f"the ledger's {len(used)} energy line(s), {gh:.2f} GPU-h"
        else:
            hours = (end - start).total_seconds() / _H
            tariff, _why = window_integral(_price(p.signals_for(start.timestamp(), end.timestamp()), pool.price_zone),
                                           start.timestamp(), end.timestamp(), "electricity price")
            if tariff is None or hours <= 0:
                notes.append(f"{t} on-prem: no energy line and no tariff for {pool.price_zone} over the period")
                continue
            try:
                watts = gpu_power_w(t)
            except UnknownGpuTypeError:  # no power figure: no rate (its work is left out and counted), never a 500
                notes.append(f"{t} on-prem: no energy line and no power figure for this GPU type")
                continue
            energy = watts / 1000.0 * pool.pue * tariff / hours / 1000.0
            how = f"modelled {watts:.0f} W x PUE {pool.pue} x {pool.price_zone}'s mean tariff"
        onprem[t] = pool.amortised_usd_per_gpu_hour + energy
        notes.append(f"{t} on-prem: {onprem[t]:.4f} USD/GPU-h = pool {pool.name} amortised "
                     f"{pool.amortised_usd_per_gpu_hour} + energy {energy:.4f} ({how})")
    return cloud, onprem, notes
