"""The cost model and the score (ARCHITECTURE §4): the one place their formulas live.

* :func:`onprem_kw`, :func:`cloud_kw` — facility power of a job's GPUs, kW;
* :func:`load_energy_kwh`, :func:`load_tariff_usd`, :func:`load_emissions_kg` — a constant load over a window;
* :func:`cloud_runtime` — expected runtime on a cloud offer (spot rework) and a pessimistic finish;
* :func:`cloud_bill_usd` — what the provider bills (from the create call, minimum billed seconds);
* :func:`cloud_cost`, :func:`onprem_cost` — an option's USD, kWh and kgCO2e;
* :func:`score` — USD, kgCO2e and waiting time as one number, USD-equivalent (lower is better).

Plain arithmetic on floats or NumPy arrays that broadcast together: the planner calls
these vectorised over offers (and jobs), the simulator with one realised run, the CLI
and the live cycle for their tables. Grid signals come in as window integrals
(:mod:`pricing.series`): a tariff in USD/MWh x h, a carbon intensity in gCO2e/kWh x h,
each over the run's window; a NaN integral (no data) gives NaN USD or kgCO2e, never 0.
Callers pass the integrals because each has its fastest way to get them (one window,
a stack of zones, prefix sums over start slots). Nothing here raises: bad input shows
as NaN (or a NumPy broadcasting error for mismatched shapes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["CloudRuntime", "CloudCost", "OnpremCost", "onprem_kw", "cloud_kw", "load_energy_kwh", "load_tariff_usd",
           "load_emissions_kg", "cloud_runtime", "cloud_bill_usd", "cloud_cost", "onprem_cost", "score"]

#: seconds per hour
_H = 3600.0


def onprem_kw(gpus, busy_kw, pue):
    """Facility power of ``gpus`` busy on-prem GPUs, kW: GPUs x board power (kW, busy) x the pool's PUE."""
    return gpus * busy_kw * pue


def cloud_kw(instances, gpus_per_node, gpu_count, busy_kw, idle_kw, pue):
    """Facility power of a job on ``instances`` cloud instances of ``gpu_count`` GPUs each, kW.

    The job's ``gpus_per_node`` GPUs of each instance are busy, the rest idle (a bigger
    instance than the job needs still draws power): ``instances x (busy GPUs x busy kW +
    idle GPUs x idle kW) x the provider's PUE``.
    """
    return instances * (gpus_per_node * busy_kw + (gpu_count - gpus_per_node) * idle_kw) * pue


def load_energy_kwh(kw, run_s):
    """Energy of a constant load of ``kw`` kW for ``run_s`` seconds, kWh."""
    return kw * run_s / _H


def load_tariff_usd(kw, tariff_integral):
    """Electricity bought at the tariff by a constant load, USD: kW x (USD/MWh x h) / 1000. May be negative."""
    return kw * tariff_integral / 1000.0


def load_emissions_kg(kw, carbon_integral):
    """Emissions of a constant load, kgCO2e: kW x (gCO2e/kWh x h) / 1000."""
    return kw * carbon_integral / 1000.0


class CloudRuntime(NamedTuple):
    """Seconds of a run on a cloud offer (floats or arrays).

    Attributes:
        expected_s: runtime plus the expected spot rework, seconds (what is billed and
            burns energy, after the provisioning delay).
        finish_bound_s: pessimistic seconds from the create call to completion, for
            deadline checks: provisioning delay + runtime + rework of ``m + 2 sqrt(m)``
            interruptions (``m`` the expected number; about the 97.5th percentile of a
            Poisson count), each losing a whole checkpoint interval (the whole run if not
            checkpointable), the restart and a new provisioning delay.
    """

    expected_s: float | np.ndarray
    finish_bound_s: float | np.ndarray


def cloud_runtime(runtime_s, spot, interruptions_per_hour, delay_s, *, checkpointable: bool,
                  checkpoint_interval_s: float, restart_s: float) -> CloudRuntime:
    """Expected and pessimistic runtime of one job (or jobs of one checkpoint policy) on cloud offers.

    Args (floats or arrays that broadcast):
        runtime_s: runtime on the offer's GPU type without interruptions, seconds.
        spot: True for a spot offer (on-demand offers are never interrupted).
        interruptions_per_hour: the offer's expected spot interruptions per instance-hour.
        delay_s: provisioning delay (create call to running container), seconds.
        checkpointable, checkpoint_interval_s: the job's checkpointing.
        restart_s: seconds a restart costs (``PlannerConfig.restart_overhead_s``).

    Interruptions are Poisson with mean ``m = rate x runtime_h``; each loses half a
    checkpoint interval on average (half the run if not checkpointable) plus the restart,
    so the expected runtime is ``runtime + m x lost``. Returns a :class:`CloudRuntime`.
    """
    if isinstance(spot, np.ndarray):
        mean = np.where(spot, interruptions_per_hour * runtime_s / _H, 0.0)
        root = np.sqrt(mean)
    else:  # one offer in plain floats (NumPy's per-call cost would dominate): the same formula
        mean = interruptions_per_hour * runtime_s / _H if spot else 0.0
        root = math.sqrt(mean)
    if checkpointable:
        lost, lost_worst = checkpoint_interval_s / 2.0 + restart_s, checkpoint_interval_s + restart_s + delay_s
    else:
        lost, lost_worst = runtime_s / 2.0 + restart_s, runtime_s + restart_s + delay_s
    return CloudRuntime(runtime_s + mean * lost, delay_s + runtime_s + (mean + 2.0 * root) * lost_worst)


def cloud_bill_usd(run_s, delay_s, usd_per_hour, min_billed_s):
    """USD a provider bills for a run of ``run_s`` seconds after a provisioning delay of ``delay_s``.

    Billing starts at the create call (boot and image pull are billed) and is per second
    after the offer's minimum: ``usd_per_hour x max(delay + run, min_billed) / 3600``.
    ``usd_per_hour`` is the price of all the job's instances (instances x the offer's price).
    """
    billed = run_s + delay_s
    billed = np.maximum(billed, min_billed_s) if isinstance(billed, np.ndarray) else max(billed, min_billed_s)
    return usd_per_hour * billed / _H


class CloudCost(NamedTuple):
    """A cloud option's cost (floats or arrays): the bill (USD), energy (kWh), emissions (kgCO2e)."""

    dollars_usd: float | np.ndarray
    energy_kwh: float | np.ndarray
    carbon_kg: float | np.ndarray


def cloud_cost(run_s, delay_s, *, usd_per_hour, min_billed_s, kw, carbon_integral) -> CloudCost:
    """USD, kWh and kgCO2e of a cloud run (floats or arrays that broadcast).

    Args:
        run_s: seconds the instances run the job after provisioning: the expected runtime
            (:func:`cloud_runtime`) when planning, the realised one when accounting.
        delay_s: provisioning delay, seconds (billed, draws no modelled power).
        usd_per_hour: price of all the job's instances, USD/h.
        min_billed_s: the offer's minimum billed seconds.
        kw: facility power of the run, kW (:func:`cloud_kw`).
        carbon_integral: the region's carbon intensity integrated over the run's window
            ``[start + delay, + run_s]``, gCO2e/kWh x h (NaN: no data).

    Dollars: :func:`cloud_bill_usd` (the electricity is in the price); energy and carbon of the
    run's load (:func:`load_energy_kwh`, :func:`load_emissions_kg`).
    """
    return CloudCost(cloud_bill_usd(run_s, delay_s, usd_per_hour, min_billed_s), load_energy_kwh(kw, run_s),
                     load_emissions_kg(kw, carbon_integral))


class OnpremCost(NamedTuple):
    """An on-prem option's cost (floats or arrays).

    Attributes:
        energy_usd: electricity at the tariff of the hours it runs, USD (may be negative).
        amortised_usd: the pool's capital for the GPU-hours used, USD (sunk for the decision:
            in the score only with ``onprem_cost_basis="amortised"``; always in reports).
        energy_kwh: facility energy, kWh.
        carbon_kg: emissions, kgCO2e.
    """

    energy_usd: float | np.ndarray
    amortised_usd: float | np.ndarray
    energy_kwh: float | np.ndarray
    carbon_kg: float | np.ndarray

    @property
    def dollars_usd(self):
        """Electricity plus amortised capital, USD (what the explain record and the ledger report)."""
        return self.energy_usd + self.amortised_usd


def onprem_cost(run_s, *, gpus, kw, usd_per_gpu_hour, tariff_integral, carbon_integral) -> OnpremCost:
    """USD, kWh and kgCO2e of an on-prem run (floats or arrays that broadcast).

    Args:
        run_s: runtime on the pool's GPU type, seconds.
        gpus: GPUs the job holds.
        kw: facility power, kW (:func:`onprem_kw`).
        usd_per_gpu_hour: the pool's amortised capital, USD per GPU-hour.
        tariff_integral: the electricity price integrated over the run's window, USD/MWh x h.
        carbon_integral: the carbon intensity integrated over the run's window, gCO2e/kWh x h.

    The load's electricity, energy and carbon (:func:`load_tariff_usd`, :func:`load_energy_kwh`,
    :func:`load_emissions_kg`); amortised: GPUs x hours x USD/GPU-h.
    """
    return OnpremCost(load_tariff_usd(kw, tariff_integral), gpus * run_s / _H * usd_per_gpu_hour,
                      load_energy_kwh(kw, run_s), load_emissions_kg(kw, carbon_integral))


def score(dollars_usd, carbon_kg, wait_s, value_of_time_usd_per_hour, carbon_price_usd_per_tonne):
    """The decision's objective (ARCHITECTURE §4), USD-equivalent, lower is better (floats or arrays).

    ``dollars + carbon_price / 1000 x kgCO2e + value_of_time x wait_h``, where the carbon
    price is in USD per tCO2e (``PlannerConfig.carbon_price_usd_per_tonne``), the value of
    time in USD per hour of waiting for the whole job (``PlannerContext.value_of_time``) and
    ``wait_s`` the seconds from now until the job runs (queue wait, deferral, provisioning
    delay). NaN in, NaN out (callers rank NaN last).
    """
    return dollars_usd + carbon_price_usd_per_tonne / 1000.0 * carbon_kg + value_of_time_usd_per_hour * wait_s / _H
