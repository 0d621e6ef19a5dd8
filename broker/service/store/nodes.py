"""Node-work repository: what the node API's long-poll watches (:mod:`broker.service.work_watch`).

Both functions read the jobs on nodes (:data:`broker.states.ON_NODE_STATES`) inside the caller's
:class:`~sqlalchemy.orm.Session`: :func:`on_node_fingerprint` (one narrow aggregate, no JSON) tells whether
anything changed; only then :func:`on_node_placements` reads which nodes the jobs are on.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.service.store.tables import Job
from broker.states import ON_NODE_STATES

__all__ = ["OnNodeFingerprint", "on_node_fingerprint", "on_node_placements"]


class OnNodeFingerprint(NamedTuple):
    """A summary of the jobs on nodes that changes whenever one of them changes: how many there are, the sum
    of their versions and the newest ``updated_at`` (UTC; ``None`` when there are none). A job leaving the set
    while another enters at the same version moves the newest change even when count and sum stay equal."""

    count: int
    version_sum: int
    newest_change: datetime | None


def on_node_fingerprint(s: Session) -> OnNodeFingerprint:
    """The :class:`OnNodeFingerprint` of the jobs in :data:`~broker.states.ON_NODE_STATES` (an index range on
    ``jobs.state``)."""
    r = s.execute(select(func.count().label("count"), func.coalesce(func.sum(Job.version), 0).label("version_sum"),
                         func.max(Job.updated_at).label("newest_change"))
                  .where(Job.state.in_(ON_NODE_STATES))).one()
    return OnNodeFingerprint(int(r.count), int(r.version_sum), r.newest_change)


def on_node_placements(s: Session) -> dict[str, frozenset[tuple[str, int]]]:
    """Node name -> the ``(job id, version)`` of the jobs in :data:`~broker.states.ON_NODE_STATES` placed on it
    (a gang job is on each of its nodes; a job without a placement is on none)."""
    nodes: dict[str, set[tuple[str, int]]] = {}
    for r in s.execute(select(Job.id, Job.version, Job.placement).where(Job.state.in_(ON_NODE_STATES))):
        for part in (r.placement or {}).get("nodes", []):
            nodes.setdefault(part.get("node"), set()).add((r.id, r.version))
    return {n: frozenset(v) for n, v in nodes.items()}
