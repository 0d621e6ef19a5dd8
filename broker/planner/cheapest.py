"""The ``cheapest`` policy: on-prem if the job fits now, else the cheapest cloud offer now.

Objective: the least USD now, ignoring carbon and the value of time. Jobs already
waiting for on-prem start in submission order; a new job starts on-prem where it
fits now, else on the available offer with the smallest expected bill (spot where the
job allows it, with the expected rework), else waits for on-prem. A job that no pool
and no offer can ever hold is rejected.
"""

from __future__ import annotations

from broker.model import Decision, DecisionKind, OptionEstimate
from broker.planner.core import PlannerContext, Snapshot
from broker.planner.policy_base import (INF, N_ALTERNATIVES, NO_OFFERS, Cycle, eligible_jobs, merged_queue,
                                        never_fits_reason, run_onprem_queue, submission_order)

__all__ = ["plan_cheapest"]


def plan_cheapest(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """Decide for the snapshot's jobs: on-prem now, else the cheapest available offer now. Returns the decisions."""
    cy = Cycle(snap, ctx)
    eligible = eligible_jobs(snap)
    committed = [j for j in eligible if j.committed_pool is not None]
    fresh = sorted((j for j in eligible if j.committed_pool is None), key=submission_order)
    run_onprem_queue(cy, merged_queue(cy, committed, submission_order), backfill=False, target_fn=cy.onprem_targets)
    for job in fresh:
        targets = cy.onprem_targets(job)
        if not targets and not (ctx.config.cloud_enabled and ctx.compatible_offers(job).size):
            cy.reject(job, never_fits_reason(job, cloud=ctx.config.cloud_enabled))
            continue
        if targets and cy.try_start_now(job, targets):
            continue
        idx = cy.available(ctx.compatible_offers(job) if ctx.config.cloud_enabled else NO_OFFERS)
        if idx.size:
            # the shape's ranking by total USD (representative work), then the exact cheapest of its top few
            top = cy.cloud_ranking(job, idx, by="dollars")[:N_ALTERNATIVES + 1].tolist()
            o = min(top, key=lambda o: (ctx.cloud_dollars(job, o), o))
            est = ctx.cloud_scalar(job, o, cy.now)
            opt = OptionEstimate(kind="cloud", target=ctx.offer_ids[o], start_s=cy.now + est.delay_s,
                                 wait_s=est.delay_s, runtime_s=est.runtime_s, dollars_usd=est.dollars_usd,
                                 energy_kwh=est.energy_kwh, carbon_kg=est.carbon_kg, score=est.dollars_usd,
                                 carbon_estimated=ctx.offer_carbon_estimated[o])
            cy.decisions.append(Decision(job.job_id, DecisionKind.provision, option=opt, offer_index=o,
                                         reason="on-prem full; cheapest offer now"))
        elif targets:
            cy.decisions.append(Decision(job.job_id, DecisionKind.wait, pool=ctx.pools[targets[0][0]].name,
                                         not_before=INF, reason="on-prem full and no cloud offer available"))
        else:
            cy.reject(job, "no on-prem pool fits and no cloud offer is available")
    return cy.decisions
