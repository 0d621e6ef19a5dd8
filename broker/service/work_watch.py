"""Long-polled node work: an agent learns of new or changed work within ~0.1 s without polling fast.

``GET /v1/node/work`` answers with an ``ETag`` (a digest of what the agent acts on: each rank's
job, attempt, state, ``cancel_requested`` and ``stop_reason``). An agent that already has that
list sends ``If-None-Match: <etag>`` and ``?wait_s=W`` (at most :data:`MAX_WAIT_S`): the API holds
the request until the node's work differs (then 200 with the new list and ETag) or ``W`` seconds
have passed (then 304, no body).

Cost, per API process, whatever the number of agents waiting (:class:`WorkWatch`):

* at most one narrow query every :data:`CHECK_S` (0.1 s) while any agent waits: ``count`` and
  ``sum(version)`` of the ``starting``/``running`` jobs (an index range on ``jobs.state``, no JSON);
* only when that changed, one read of the active jobs' ``(id, version, placement)`` (O(active jobs))
  to find which nodes' jobs changed;
* only for an agent whose node's jobs changed, one :func:`broker.service.attempts.node_work` (its usual poll).

A waiting request holds no thread (the route is ``async``; the queries run in the thread pool),
only its connection: an agent holds two (its loop's and its long-poll's), so keep
``api_max_connections`` (per API process) above twice the number of agents, and
``api_max_connections_per_peer`` above twice the number of agents that reach the API from one address
(behind one NAT gateway; 64 by default: 32 such agents). Changes that do not
move a job's version (none today) are seen when the wait ends.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

from broker.service.store import nodes as node_rows
from broker.service.store.core import JobStore

__all__ = ["WorkWatch", "work_etag", "MAX_WAIT_S", "CHECK_S"]

#: longest wait a long-poll may ask for, seconds (``?wait_s=``)
MAX_WAIT_S = 10.0
#: how often a waiting long-poll's node is checked for changes, seconds
CHECK_S = 0.1


def work_etag(work: list[dict]) -> str:
    """The ETag of a node's work list (:func:`broker.service.attempts.node_work`): a quoted 16-hex-digit digest
    of each rank's ``job_id``, ``attempt``, ``rank``, ``state``, ``cancel_requested``, ``stop_reason``
    (the spec of an attempt never changes)."""
    key = sorted((w["job_id"], w["attempt"], w["rank"], w["state"], bool(w["cancel_requested"]),
                  w["stop_reason"] or "") for w in work)
    return '"' + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16] + '"'


class WorkWatch:
    """Which nodes' active jobs changed, read at most every ``check_s`` seconds and shared by every
    waiting request of this process (thread-safe; see the module docstring for the cost).

    Args:
        store: the job store.
        check_s: seconds between two reads of the store, > 0.
    """

    def __init__(self, store: JobStore, check_s: float = CHECK_S):
        if not check_s > 0:
            raise ValueError(f"check_s={check_s!r}: must be > 0 seconds")
        self.store = store
        self.check_s = check_s
        self._lock = threading.Lock()
        self._read_at = -1e9
        self._fingerprint: node_rows.OnNodeFingerprint | None = None
        self._nodes: dict[str, frozenset] = {}

    def node_state(self, node: str) -> frozenset:
        """The ``(job id, version)`` of the active jobs placed on ``node``, at most ``check_s`` old.
        Blocking (database); call it from a worker thread."""
        with self._lock:
            if time.monotonic() - self._read_at >= self.check_s:
                self._refresh()
            return self._nodes.get(node, frozenset())

    def _refresh(self) -> None:
        with self.store.session() as s:
            fp = node_rows.on_node_fingerprint(s)  # count, sum of versions and newest change
            if fp != self._fingerprint:
                self._nodes = node_rows.on_node_placements(s)
                self._fingerprint = fp
        self._read_at = time.monotonic()
