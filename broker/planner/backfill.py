"""The ``backfill`` policy: on-prem only, priority -> fair share -> age, EASY backfill.

Objective: keep the on-prem GPUs busy without starving the head of the queue. Jobs are
taken by priority class, then team fair share, then age; the first job that does not fit
gets a reservation and later jobs may start only if they do not delay it
(:func:`broker.planner.policy_base.run_onprem_queue`). A job no pool can ever hold is rejected.
"""

from __future__ import annotations

from broker.model import Decision
from broker.planner.core import PlannerContext, Snapshot
from broker.planner.policy_base import Cycle, eligible_jobs, merged_queue, run_onprem_queue

__all__ = ["plan_backfill"]


def plan_backfill(snap: Snapshot, ctx: PlannerContext) -> list[Decision]:
    """Start the snapshot's jobs on-prem in queue order with EASY backfill. Returns the decisions."""
    cy = Cycle(snap, ctx)
    queue = merged_queue(cy, eligible_jobs(snap), cy.queue_key)
    run_onprem_queue(cy, queue, backfill=True, target_fn=cy.onprem_targets, reject_unplaceable=True)
    return cy.decisions
