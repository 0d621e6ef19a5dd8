"""The policies by name, and :func:`plan`: the planner's entry point (ARCHITECTURE §3).

``plan(snapshot, ctx) -> decisions`` runs the policy ``ctx.config.policy`` names. The
live cycle (:mod:`broker.service.cycle`) and the simulator (:mod:`broker.sim.simulator`)
both call it. A new policy is one module of this package and one row of :data:`POLICIES`.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

from broker.model import Decision
from broker.planner.backfill import plan_backfill
from broker.planner.cheapest import plan_cheapest
from broker.planner.core import PlannerContext, PlannerError, PolicyName, Snapshot
from broker.planner.federated import plan_federated
from broker.planner.fifo import plan_fifo

__all__ = ["Policy", "POLICIES", "plan"]


@dataclass(frozen=True)
class Policy:
    """One planning policy.

    Attributes:
        name: its :class:`~broker.planner.core.PolicyName`.
        decide: ``(snapshot, context) -> decisions``; pure.
        uses_cloud: False for the on-prem-only policies (the simulator gives them no offers).
        uses_carbon_price: True if its decisions depend on ``PlannerConfig.carbon_price_usd_per_tonne``
            (``simulate --sweep-carbon-price`` re-runs only these at each price; one run of the others serves
            every price). ``cheapest`` ranks offers by USD alone; fifo and backfill place by order.
    """

    name: PolicyName
    decide: Callable[[Snapshot, PlannerContext], list[Decision]]
    uses_cloud: bool
    uses_carbon_price: bool


#: every policy, by name (one row per :class:`~broker.planner.core.PolicyName`)
POLICIES: dict[PolicyName, Policy] = {p.name: p for p in (
    Policy(PolicyName.fifo, plan_fifo, uses_cloud=False, uses_carbon_price=False),
    Policy(PolicyName.backfill, plan_backfill, uses_cloud=False, uses_carbon_price=False),
    Policy(PolicyName.cheapest, plan_cheapest, uses_cloud=True, uses_carbon_price=False),
    Policy(PolicyName.federated, plan_federated, uses_cloud=True, uses_carbon_price=True),
)}
if set(POLICIES) != set(PolicyName):  # pragma: no cover - a PolicyName without a row is a programming error
    raise ImportError(f"broker.planner.registry: no policy module for {sorted(set(PolicyName) - set(POLICIES))}")


def plan(snapshot: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """Decide for the jobs in ``snapshot`` under ``ctx.config.policy``.

    Returns a list of :class:`broker.model.Decision`. Pure: reads the snapshot
    and the context, writes neither (the context's caches aside).
    Raises :class:`~broker.planner.core.PlannerError` for an inconsistent snapshot.
    """
    if len(snapshot.free) != len(ctx.pools):
        raise PlannerError(f"free: {len(snapshot.free)} arrays for {len(ctx.pools)} pools")
    decide = POLICIES[ctx.config.policy].decide
    # A big cycle allocates ~5 small objects per job and no reference cycles; pausing the
    # cyclic garbage collector meanwhile saves ~40 % of a 100k-job cycle.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return decide(snapshot, ctx)
    finally:
        if gc_was_enabled:
            gc.enable()
