"""The simulator's usage records (issue #12 item 3): the live ledger's lines, built from a simulated run.

A simulated run meters what the live ledger (:mod:`broker.service.ledger`) meters, as the same
:class:`broker.usage.UsageRecord` with ``source="sim"``, so a what-if run and actual use are read by the same
reports (:func:`broker.usage.chargeback`, :func:`broker.usage.write_usage_csv`). The rules are the live
ledger's, from their one home:

* **cloud** (``line="instance"``), one per instance (a job on ``nodes`` instances has ranks ``0..nodes-1``),
  from the create call to the end of the run (finish or spot interruption): ``billed_s`` by
  :func:`pricing.billing.billed_seconds` (per second, 60-s minimum), USD by
  :func:`broker.planner.costs.cloud_bill_usd` at the offer's list price (``list_unit_price_usd``, USD per
  instance-hour). :func:`cloud_instance_bill` is what the simulator's ``cost_usd`` adds up too.
* **on-prem**, per rank (one node's share of the allocation), from the start to the end of the run (finish
  or preemption): ``line="energy"``: :func:`broker.planner.costs.onprem_cost` with the rank's GPUs busy
  (:func:`broker.planner.costs.onprem_kw`: the GPU table's busy kW x the pool's PUE), priced at the pool's
  price zone's hourly tariff (``list_unit_price_usd`` the window's mean, USD per kWh); ``line="amortised"``:
  GPUs x hours x the pool's amortised USD per GPU-hour, its own line.
* kgCO2e is **location-based**: the zone's hourly average intensity over the window.

Where a simulated run differs from live metering (said in each record's ``estimate_reasons``): power is the
simulator's model, not an energy counter (every energy and instance line is ``estimated``); a cloud
instance draws no modelled power while it provisions (billed, not powered: the simulator's cost model), and
its GPUs the job does not use draw idle power; an hour with no price or carbon value is not interpolated as
the live ledger does within 3 h: the figure is ``None`` with the reason (the run's metrics count it as 0 and
report ``missing_signal_hours``). Attempts are numbered from 1, as the live broker numbers them; resource
ids of simulated instances are ``sim-<offer id>-<job>-<attempt>-<rank>``.

So per run: the records' ``billed_usd`` of instance and energy lines add up to ``cost_usd``, of amortised
lines to ``onprem_amortised_usd``; ``energy_kwh`` and ``carbon_kg`` to the run's (tests/broker/sim/test_ledger.py).
"""

from __future__ import annotations

import math
import sys
from datetime import datetime, timezone
from typing import Sequence

from broker.model import CloudOffer, Pool
from broker.planner.costs import cloud_bill_usd, cloud_kw, load_emissions_kg, load_energy_kwh, onprem_cost, onprem_kw
from broker.usage import PRICING_UNITS, UsageRecord
from pricing.billing import billed_seconds

__all__ = ["cloud_instance_bill", "cloud_records", "onprem_records"]

_H = 3600.0


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def cloud_instance_bill(offer: CloudOffer, window_s: float) -> tuple[float, float]:
    """``(billed_s, usd)`` of one instance of ``offer`` billed for ``window_s`` seconds from its create call:
    :func:`pricing.billing.billed_seconds` of the offer's provider (at least the offer's ``min_billed_s``), USD at
    the offer's price (:func:`broker.planner.costs.cloud_bill_usd`)."""
    billed = max(billed_seconds(offer.provider, window_s), offer.min_billed_s)
    return billed, float(cloud_bill_usd(billed, 0.0, offer.usd_per_hour, offer.min_billed_s))


def cloud_records(*, job_id: str, team: str, attempt: int, offer: CloudOffer, nodes: int, gpus_per_node: int,
                  provision_s: float, start_s: float, end_s: float, busy_kw: float, idle_kw: float,
                  carbon_integral: float) -> list[UsageRecord]:
    """One ``instance`` record per instance of a cloud run.

    Args:
        job_id, team: the job. attempt: 1-based attempt number.
        offer: the instances' offer; nodes: instances; gpus_per_node: the job's GPUs on each (busy; the rest idle).
        provision_s: the create call, start_s: the instances ready, end_s: the run's end (POSIX s, UTC).
        busy_kw, idle_kw: board power of one GPU of the offer's type, busy and idle, kW.
        carbon_integral: the region's carbon intensity over ``[start_s, end_s]``, gCO2e/kWh x h (NaN: no data).
    """
    run = max(end_s - start_s, 0.0)
    window = max(end_s - provision_s, 0.0)
    billed, usd = cloud_instance_bill(offer, window)
    kw = cloud_kw(1, gpus_per_node, offer.gpu_count, busy_kw, idle_kw, offer.pue)
    energy = float(load_energy_kwh(kw, run))
    # reasons repeat across records: interned, one string each in memory and in a pickle
    why = [sys.intern(f"simulated: power modelled ({gpus_per_node} busy + {offer.gpu_count - gpus_per_node} idle "
                      f"{offer.gpu_type} x PUE {offer.pue}), none while provisioning")]
    if math.isnan(carbon_integral):
        carbon = None
        why.append(sys.intern(f"no carbon intensity for the window in {offer.carbon_zone}"))
    else:
        carbon = float(load_emissions_kg(kw, carbon_integral))
    t0, t1 = _utc(provision_s), _utc(max(end_s, provision_s))
    return [UsageRecord(job_id=job_id, attempt=attempt, rank=r, line="instance",
                        resource=f"sim-{offer.offer_id}-{job_id}-{attempt}-{r}", team=team, start=t0, end=t1,
                        provider=offer.provider, region=offer.region, zone=offer.zone,
                        instance_type=offer.instance_type, market=offer.market.value, gpu_type=offer.gpu_type,
                        gpu_count=offer.gpu_count, run_s=window, billed_s=billed,
                        list_unit_price_usd=offer.usd_per_hour, billed_usd=usd, energy_kwh=energy,
                        carbon_kg=carbon, estimated=True, estimate_reasons=tuple(why), source="sim")
            for r in range(nodes)]


def onprem_records(*, job_id: str, team: str, attempt: int, pool: Pool, allocation: Sequence[tuple[int, int]],
                   gpu_type: str, start_s: float, end_s: float, busy_kw: float, tariff_integral: float,
                   carbon_integral: float) -> list[UsageRecord]:
    """An ``energy`` and an ``amortised`` record per rank (node) of an on-prem run.

    Args:
        job_id, team: the job. attempt: 1-based attempt number.
        pool: the pool; allocation: ``(node index in pool.nodes, GPUs)`` per rank, in rank order.
        gpu_type: the nodes' GPU type; busy_kw: board power of one busy GPU of it, kW.
        start_s, end_s: the run's window (POSIX s, UTC).
        tariff_integral: the pool's price zone's price over the window, USD/MWh x h (NaN: no data).
        carbon_integral: its carbon zone's intensity over the window, gCO2e/kWh x h (NaN: no data).
    """
    run = max(end_s - start_s, 0.0)
    t0, t1 = _utc(start_s), _utc(max(end_s, start_s))
    out = []
    for rank, (node, g) in enumerate(allocation):
        c = onprem_cost(run, gpus=g, kw=onprem_kw(g, busy_kw, pool.pue),
                        usd_per_gpu_hour=pool.amortised_usd_per_gpu_hour, tariff_integral=tariff_integral,
                        carbon_integral=carbon_integral)
        why = [sys.intern(f"simulated: power modelled ({g} busy {gpu_type} x PUE {pool.pue}), no energy counter")]
        if math.isnan(tariff_integral):
            why.append(sys.intern(f"no electricity price for the window in {pool.price_zone}"))
        if math.isnan(carbon_integral):
            why.append(sys.intern(f"no carbon intensity for the window in {pool.carbon_zone}"))
        common = dict(job_id=job_id, attempt=attempt, rank=rank, resource=pool.nodes[node].name, team=team,
                      start=t0, end=t1, provider="onprem", region=pool.price_zone, pool=pool.name,
                      gpu_type=gpu_type, gpu_count=g, run_s=run, billed_s=run, source="sim")
        mean_tariff = tariff_integral / (run / _H) / 1000.0 if run > 0 and not math.isnan(tariff_integral) else None
        out.append(UsageRecord(**common, line="energy", pricing_unit=PRICING_UNITS["energy"],
                               list_unit_price_usd=mean_tariff,
                               billed_usd=None if math.isnan(tariff_integral) else float(c.energy_usd),
                               energy_kwh=float(c.energy_kwh),
                               carbon_kg=None if math.isnan(carbon_integral) else float(c.carbon_kg),
                               estimated=True, estimate_reasons=tuple(why)))
        out.append(UsageRecord(**common, line="amortised", pricing_unit=PRICING_UNITS["amortised"],
                               list_unit_price_usd=pool.amortised_usd_per_gpu_hour,
                               billed_usd=float(c.amortised_usd), energy_kwh=0.0, carbon_kg=0.0))
    return out
