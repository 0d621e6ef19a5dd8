"""Bundled inputs for a simulation or an offers query: pools, cloud offers, grid signals, spot traces.

:func:`load_scenario` gathers everything the planner and simulator need from
the data bundled in ``pricing/data`` and ``broker/data`` (no network). Every
zone referenced by a pool or an offer must have a carbon series; a pool's
price zone must have an electricity price series (else ``ValueError`` naming
the pool and zone). With ``signals_dir`` the user's hourly series
(:mod:`pricing.user_signals`) replace the bundled ones for the zones they give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from broker.cluster import load_cluster
from broker.model import CloudOffer, Pool
from broker.planner.core import GpuTable

__all__ = ["Scenario", "load_scenario", "pool_problems"]


@dataclass
class Scenario:
    """Static inputs of a run.

    Attributes:
        pools: on-prem pools.
        offers: priced cloud offers (AWS + GCP, spot + on-demand).
        offers_skipped: reason -> catalog rows not turned into offers.
        signals: ``pricing.signals.GridSignals`` for every zone used.
        spot_traces: ``pricing.spot.SpotTrace`` list.
        gpus: GPU throughput/power table.
        user_signals: the ``pricing.user_signals.UserSignals`` read with ``signals_dir`` (None: bundled only).
    """

    pools: list[Pool]
    offers: list[CloudOffer]
    offers_skipped: dict[str, int]
    signals: object
    spot_traces: list = field(default_factory=list)
    gpus: GpuTable | None = None
    user_signals: object = None


def pool_problems(pools, user=None) -> list[str]:
    """One line per node GPU type the power/throughput table does not know (``pool 'p', node 'a':
    gpu_type='Z9000': unknown GPU type; known: ...``) and per pool zone without a series (``pool 'hpc':
    carbon_zone='XX-NOWHERE' has no bundled series; available: ...``, then ``price_zone``), in pool order;
    ``[]`` when there is none: what the planner and the live broker would refuse the cluster file for.

    ``pools`` are :class:`broker.model.Pool`; ``user`` the :class:`pricing.user_signals.UserSignals` whose zones
    count as covered too (``None``: the bundled series of :mod:`pricing.carbon` / :mod:`pricing.electricity`
    only, as the live broker uses)."""
    from pricing.carbon import available_carbon_zones
    from pricing.electricity import available_price_zones

    carbon_zones = set(available_carbon_zones()) | set(user.carbon if user else ())
    price_zones = set(available_price_zones()) | set(user.price if user else ())
    from pricing.power import UnknownGpuTypeError, canonical_gpu_type

    out = []
    for p in pools:
        for nd in p.nodes:
            try:
                canonical_gpu_type(nd.gpu_type)
            except UnknownGpuTypeError as e:
                out.append(f"pool {p.name!r}, node {nd.name!r}: {e}")
        if p.carbon_zone not in carbon_zones:
            out.append(f"pool {p.name!r}: carbon_zone={p.carbon_zone!r} has no bundled series; "
                       f"available: {', '.join(sorted(carbon_zones))}")
        if p.price_zone not in price_zones:
            out.append(f"pool {p.name!r}: price_zone={p.price_zone!r} has no bundled series; "
                       f"available: {', '.join(sorted(price_zones))}")
    return out


def load_scenario(cluster: str | Path | None = None, with_pools: bool = True,
                  signals_dir: str | Path | None = None) -> Scenario:
    """Load the default (or ``cluster``) on-prem pools and all bundled offers and signals.

    ``signals_dir``: a folder of user carbon/price CSVs (:func:`pricing.user_signals.load_user_signals`) used in
    place of the bundled series of the zones it gives (``Scenario.user_signals``).
    Raises ``broker.cluster.ClusterError`` for a bad cluster file and ``ValueError``
    when a pool names a zone without bundled or user data (or a user file is malformed).
    """
    from pricing.catalog import load_offers
    from pricing.signals import load_grid_signals
    from pricing.spot import load_spot_traces
    from pricing.user_signals import grid_signals_with, load_user_signals

    from pricing.power import UnknownGpuTypeError, canonical_gpu_type

    pools = load_cluster(cluster) if with_pools else []
    canon = []
    for p in pools:  # GPU types as the power/throughput table spells them (v100 -> V100)
        nodes = []
        for nd in p.nodes:
            try:
                g = canonical_gpu_type(nd.gpu_type)
            except UnknownGpuTypeError as e:
                raise ValueError(f"pool {p.name!r}, node {nd.name!r}: {e}") from None
            nodes.append(nd if g == nd.gpu_type else nd.model_copy(update={"gpu_type": g}))
        canon.append(p.model_copy(update={"nodes": tuple(nodes)}))
    pools = canon
    user = load_user_signals(signals_dir) if signals_dir is not None else None
    problems = pool_problems(pools, user)
    if problems:
        raise ValueError(problems[0])
    cat = load_offers()
    zones = {p.carbon_zone for p in pools} | {p.price_zone for p in pools} | {o.carbon_zone for o in cat.offers}
    signals = grid_signals_with(sorted(zones), user) if user else load_grid_signals(sorted(zones))
    return Scenario(pools=pools, offers=list(cat.offers), offers_skipped=dict(cat.skipped), signals=signals,
                    spot_traces=load_spot_traces(), gpus=GpuTable.from_pricing(), user_signals=user)
