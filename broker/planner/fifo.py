"""The ``fifo`` policy: on-prem only, strict submission order, no backfill.

Objective: none beyond order. Jobs start in submission order where the whole gang fits
now; the first job that does not fit blocks every later one (the baseline the others
are measured against). A job no pool can ever hold is rejected.
"""

from __future__ import annotations

from broker.model import Decision
from broker.planner.core import PlannerContext, Snapshot
from broker.planner.policy_base import Cycle, eligible_jobs, merged_queue, run_onprem_queue, submission_order

__all__ = ["plan_fifo"]


def plan_fifo(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """Start the snapshot's jobs on-prem in submission order until one does not fit. Returns the decisions."""
    cy = Cycle(snap, ctx)
    queue = merged_queue(cy, eligible_jobs(snap), submission_order)
    run_onprem_queue(cy, queue, backfill=False, target_fn=cy.onprem_targets, reject_unplaceable=True)
    return cy.decisions
