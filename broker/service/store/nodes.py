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

from broker.service.store.tables import Job, Node
from broker.states import ACTIVE_STATE_VALUES, ON_NODE_STATES

__all__ = ["OnNodeFingerprint", "on_node_fingerprint", "on_node_placements", "NodeCapacity", "node_capacity"]


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


class NodeCapacity(NamedTuple):
    """The agent nodes of one pool and GPU type in aggregate (:func:`node_capacity`): counts of nodes and GPUs."""

    pool: str
    gpu_type: str
    nodes: int
    nodes_up: int
    gpus: int
    healthy_gpus: int
    free_gpus: int


def node_capacity(s: Session, heard_since: datetime) -> list[NodeCapacity]:
    """Per (pool, GPU type) of the registered nodes, by pool then type: nodes, nodes up (state ``up`` and a
    heartbeat at or after ``heard_since``, as the planner's live nodes), GPUs, healthy GPUs of the nodes up, and
    free GPUs: those healthy GPUs that no on-prem job in :data:`~broker.states.ACTIVE_STATES` holds (its
    placement's GPUs on the node, as the planning cycle counts them)."""
    held: dict[str, set[int]] = {}
    for (placement,) in s.execute(select(Job.placement).where(Job.state.in_(ACTIVE_STATE_VALUES))):
        if (placement or {}).get("kind") != "onprem":
            continue
        for part in placement.get("nodes", []):
            held.setdefault(part.get("node"), set()).update(part.get("gpus", []))
    out: dict[tuple[str, str], list[int]] = {}
    for n in s.execute(select(Node).order_by(Node.pool, Node.gpu_type, Node.name)).scalars():
        row = out.setdefault((n.pool, n.gpu_type), [0, 0, 0, 0, 0])
        up = n.state == "up" and n.last_heartbeat_at is not None and _aware(n.last_heartbeat_at) >= heard_since
        healthy = set(n.healthy_gpus or ()) if up else set()
        row[0] += 1
        row[1] += up
        row[2] += n.gpu_count
        row[3] += len(healthy)
        row[4] += len(healthy - held.get(n.name, set()))
    return [NodeCapacity(pool, gpu_type, *v) for (pool, gpu_type), v in sorted(out.items())]


def _aware(t: datetime) -> datetime:
    """``t`` as aware UTC (SQLite gives naive UTC datetimes back)."""
    from datetime import timezone

    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def on_node_placements(s: Session) -> dict[str, frozenset[tuple[str, int]]]:
    """Node name -> the ``(job id, version)`` of the jobs in :data:`~broker.states.ON_NODE_STATES` placed on it
    (a gang job is on each of its nodes; a job without a placement is on none)."""
    nodes: dict[str, set[tuple[str, int]]] = {}
    for r in s.execute(select(Job.id, Job.version, Job.placement).where(Job.state.in_(ON_NODE_STATES))):
        for part in (r.placement or {}).get("nodes", []):
            nodes.setdefault(part.get("node"), set()).add((r.id, r.version))
    return {n: frozenset(v) for n, v in nodes.items()}
