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
  ``billed_s`` by :func:`pricing.billing.billed_seconds`; USD by :func:`~broker.planner.costs.cloud_bill_usd`
  at the offer's list price. Energy: modelled power (every GPU of the instance busy, :func:`pricing.power.
  gpu_power_w` at its default utilisation) x the provider's PUE (flagged: cloud instances give no counter);
  kgCO2e at the region's hourly carbon intensity.
* **on-prem**, per rank (one node's GPUs), from the attempt's start to its end: ``line="energy"``: the
  GPUs' NVML total-energy counters (read at the start by :func:`snapshot_counters`, at the end from the
  node's last heartbeat): their mean power over the attempt's window (flagged when the readings' window
  differs from the run by more than 5 %, or 1 s, whichever is more), x
  the pool's PUE, priced at the pool's price zone's hourly tariff and carbon
  (:func:`~broker.planner.costs.onprem_cost` with the counter's mean power); where a GPU has no counter,
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
wiring installs its planning environment's), else one built on first use from the cluster file given to
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
from broker.planner.costs import cloud_bill_usd, cloud_kw, load_emissions_kg, load_energy_kwh, onprem_cost
from broker.usage import GPU_HOUR_LINES, PRICING_UNITS, UsageRecord
from pricing.billing import billed_seconds, billing_rule
from pricing.power import DEFAULT_UTILISATION, gpu_power_w
from pricing.storage import BOOT_DISKS, disk_bill, disk_rate

__all__ = ["FILL_HOURS", "LedgerPrices", "install", "configure", "prices", "snapshot_counters", "meter_attempt",
           "meter_instance_ends", "meter_pool_idle", "counterfactual_rates", "window_integral"]

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
    """

    offers: Mapping[str, CloudOffer]
    pools: Mapping[str, Pool]
    signals_at: Callable[[float], Any]

    @classmethod
    def of(cls, offers: Iterable[CloudOffer], pools: Iterable[Pool], signals: Any) -> "LedgerPrices":
        """From offers, pools and one signals object (series on real instants)."""
        return cls({o.offer_id: o for o in offers}, {p.name: p for p in pools}, lambda _t: signals)

    @classmethod
    def from_environment(cls, env) -> "LedgerPrices":
        """From a :class:`broker.service.live.LiveEnvironment`: its offers, its cluster file's pools, and its
        replayed signals (the replay offset of the window's start)."""
        from broker.service.live import ReplayedSignals

        base, offset_for = env.base_signals, env.offset_for
        return cls({o.offer_id: o for o in env.offers}, dict(env.site_pools),
                   lambda t: ReplayedSignals(base, offset_for(t)))


_lock = threading.Lock()
_installed: LedgerPrices | None = None
_cluster: Path | None = None


def install(p: LedgerPrices | None) -> None:
    """Make ``p`` the ledger's prices in this process (``None``: build them again on next use)."""
    global _installed
    with _lock:
        _installed = p


def configure(cluster: str | Path | None) -> None:
    """The cluster file the lazily built prices read (``None``: the bundled live cluster); forgets built ones."""
    global _cluster, _installed
    with _lock:
        if (Path(cluster) if cluster else None) != _cluster:
            _cluster, _installed = (Path(cluster) if cluster else None), None


def prices() -> LedgerPrices:
    """This process's :class:`LedgerPrices` (see the module docstring)."""
    global _installed
    with _lock:
        if _installed is None:
            from broker.planner.core import PlannerConfig
            from broker.service.live import LiveEnvironment

            _installed = LedgerPrices.from_environment(LiveEnvironment(PlannerConfig(), _cluster))
        return _installed


# ----------------------------------------------------------------------------- signals
def _hour(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:00Z")


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
        return _meter_scheduler(att, end, base, p)
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


def _instance_line(att, row, line: str, start: datetime, stop: datetime, usd_of: Callable[[float], float],
                   billed: float, base: dict, p: LedgerPrices, why: list[str]) -> UsageRecord:
    """An ``instance`` or ``idle`` line of ``row`` over ``[start, stop]``: ``billed`` seconds, ``usd_of(list USD/h)``
    USD; modelled power: every GPU busy on an ``instance`` line, idle on an ``idle`` one."""
    offer = p.offers.get(row.offer_id)
    run_s = (stop - start).total_seconds()
    gpu_type, gpu_count = _gpus(att, offer)
    if offer is None:
        usd = energy = carbon = price = None
        why.append(f"offer {row.offer_id!r} not in the price catalog: no price, power or carbon zone")
    else:
        price = offer.usd_per_hour
        usd = float(usd_of(price))
        w = gpu_power_w(offer.gpu_type, 0.0 if line == "idle" else DEFAULT_UTILISATION) / 1000.0
        kw = cloud_kw(1, offer.gpu_count, offer.gpu_count, w, w, offer.pue)
        energy = float(load_energy_kwh(kw, run_s))
        how = "idle" if line == "idle" else "at the default utilisation"
        why.append(f"power modelled ({offer.gpu_count} x {offer.gpu_type} {how} x PUE {offer.pue}): cloud "
                   "instances give no energy counter")
        ci, cwhy = window_integral(_carbon(p, offer.carbon_zone, start), start.timestamp(), stop.timestamp(),
                                   "carbon intensity")
        carbon = None if ci is None else float(load_emissions_kg(kw, ci))
        why += cwhy
    return UsageRecord(**base, rank=row.rank, line=line, resource=row.provider_instance_id, start=start, end=stop,
                       provider=row.provider, region=row.region, zone=row.zone, instance_type=row.instance_type,
                       market=row.market, gpu_type=gpu_type, gpu_count=gpu_count, run_s=run_s, billed_s=billed,
                       list_unit_price_usd=price, billed_usd=usd, energy_kwh=energy, carbon_kg=carbon,
                       estimated=bool(why), estimate_reasons=tuple(why))


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
        rule_min = billing_rule(row.provider).min_billed_s
        out.append(_instance_line(att, row, "instance", row.created_at, stop,
                                  lambda usd_h: cloud_bill_usd(billed, 0.0, usd_h, rule_min), billed, base, p, why))
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
        rule_min = billing_rule(row.provider).min_billed_s
        stopped = _stopped_at(att, row)
        busy_to = max(row.created_at, min(deleted, stopped)) if stopped is not None else deleted
        busy_s = (busy_to - row.created_at).total_seconds()
        if not _used(att, row):
            billed = billed_seconds(row.provider, busy_s)
            out.append(_instance_line(att, row, "idle", row.created_at, busy_to,
                                      lambda usd_h: cloud_bill_usd(billed, 0.0, usd_h, rule_min), billed, base, p,
                                      why))
        elif busy_to > end:
            job_s = max(0.0, (end - row.created_at).total_seconds())
            b_all, b_job = billed_seconds(row.provider, busy_s), billed_seconds(row.provider, job_s)
            out.append(_instance_line(
                att, row, "idle", max(end, row.created_at), busy_to,
                lambda usd_h: (cloud_bill_usd(b_all, 0.0, usd_h, rule_min) - cloud_bill_usd(b_job, 0.0, usd_h, rule_min)),
                b_all - b_job, base, p, why))
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


def _carbon(p: LedgerPrices, zone: str, at: datetime):
    try:
        return p.signals_at(at.timestamp()).carbon(zone)
    except ValueError:
        return None


def _price(p: LedgerPrices, zone: str, at: datetime):
    try:
        return p.signals_at(at.timestamp()).price(zone)
    except ValueError:
        return None


def _meter_onprem(s, att, end: datetime, base: dict, p: LedgerPrices) -> list[UsageRecord]:
    from broker.service.store.tables import Node

    if att.started_at is None:  # nothing ran: the held GPUs are idle time (a later line)
        return []
    pool = p.pools.get(att.pool or "")
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
        tariff, twhy = window_integral(_price(p, pool.price_zone, att.started_at), t0, t1,
                                       "electricity price")
        ci, cwhy = window_integral(_carbon(p, pool.carbon_zone, att.started_at), t0, t1, "carbon intensity")
        c = onprem_cost(run_s, gpus=len(gpus), kw=kw, usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour,
                        tariff_integral=tariff if tariff is not None else math.nan,
                        carbon_integral=ci if ci is not None else math.nan)
        ewhy = why + twhy + cwhy
        mean_tariff = (tariff / (run_s / _H) / 1000.0) if tariff is not None and run_s > 0 else None
        out.append(UsageRecord(**common, line="energy", pricing_unit=PRICING_UNITS["energy"],
                               region=pool.price_zone, list_unit_price_usd=mean_tariff,
                               billed_usd=None if tariff is None else float(c.energy_usd),
                               energy_kwh=float(c.energy_kwh), carbon_kg=None if ci is None else float(c.carbon_kg),
                               estimated=bool(ewhy), estimate_reasons=tuple(ewhy)))
        awhy = clock + _unreported(att, rank)
        out.append(UsageRecord(**common, line="amortised", pricing_unit=PRICING_UNITS["amortised"],
                               region=pool.price_zone,
                               list_unit_price_usd=pool.amortised_usd_per_gpu_hour,
                               billed_usd=float(c.amortised_usd), energy_kwh=0.0, carbon_kg=0.0,
                               estimated=bool(awhy), estimate_reasons=tuple(awhy)))
    return out


def _meter_scheduler(att, end: datetime, base: dict, p: LedgerPrices) -> list[UsageRecord]:
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
    tariff, twhy = window_integral(_price(p, pool.price_zone, att.started_at), t0, t1, "electricity price")
    ci, cwhy = window_integral(_carbon(p, pool.carbon_zone, att.started_at), t0, t1, "carbon intensity")
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
                        estimated=bool(ewhy), estimate_reasons=tuple(ewhy)),
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
def counterfactual_rates(p: LedgerPrices, records: Iterable[UsageRecord], start: datetime, end: datetime
                         ) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """The USD per GPU-hour :func:`broker.usage.savings` prices the counterfactuals at, for each GPU type of
    ``records`` (the period ``[start, end)``, UTC), and how each was found. Returns ``(cloud, onprem, notes)``.

    * **all on the cheapest cloud now**: the lowest ``usd_per_hour / gpu_count`` of the price catalog's offers
      of that type, any provider, region and market (spot included: its price now, not its interruptions);
      billing minimums and boot time left out, so the figure is a floor.
    * **on-prem only**: the lowest amortised USD per GPU-hour of a pool with a node of that type, plus the
      energy USD per GPU-hour: the ledger's own energy lines of that type in the records (their USD / their
      GPU-hours); with none, the modelled power of the type (:func:`pricing.power.gpu_power_w`) x the pool's PUE
      x the pool zone's mean tariff over the period. The pools' capacity is not a limit here (the simulator's
      runs show the queueing an on-prem-only placement would add).

    A type with no offer, or no pool, or no tariff, has no rate on that side (its work is left out and
    counted by :func:`broker.usage.savings`)."""
    from pricing.power import canonical_or_same

    records = list(records)
    types = sorted({r.gpu_type for r in records if r.line in GPU_HOUR_LINES})
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
        pools = [pl for pl in p.pools.values() if any(canonical_or_same(n.gpu_type) == ct for n in pl.nodes)]
        if not pools:
            notes.append(f"{t} on-prem: no pool has this type")
            continue
        pool = min(pools, key=lambda pl: (pl.amortised_usd_per_gpu_hour, pl.name))
        used = [r for r in records if r.line == "energy" and r.gpu_type == t and r.billed_usd is not None]
        gh = sum(r.gpu_hours for r in used)
        if gh > 0:
            energy = math.fsum(r.billed_usd for r in used) / gh
            how = f"the ledger's {len(used)} energy line(s), {gh:.2f} GPU-h"
        else:
            hours = (end - start).total_seconds() / _H
            tariff, _why = window_integral(_price(p, pool.price_zone, start), start.timestamp(), end.timestamp(),
                                           "electricity price")
            if tariff is None or hours <= 0:
                notes.append(f"{t} on-prem: no energy line and no tariff for {pool.price_zone} over the period")
                continue
            energy = gpu_power_w(t) / 1000.0 * pool.pue * tariff / hours / 1000.0
            how = f"modelled {gpu_power_w(t):.0f} W x PUE {pool.pue} x {pool.price_zone}'s mean tariff"
        onprem[t] = pool.amortised_usd_per_gpu_hour + energy
        notes.append(f"{t} on-prem: {onprem[t]:.4f} USD/GPU-h = pool {pool.name} amortised "
                     f"{pool.amortised_usd_per_gpu_hour} + energy {energy:.4f} ({how})")
    return cloud, onprem, notes
