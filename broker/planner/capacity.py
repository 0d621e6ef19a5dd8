"""Free on-prem capacity: best-fit placement and the release profile of running jobs.

:class:`FreeIndex` keeps, per GPU type, the nodes bucketed by their number of
free GPUs (0..16). Best-fit for a node needing ``g`` GPUs is the non-empty bucket
with the smallest count ``>= g``: at most 17 bucket probes, independent of the
number of nodes. Gangs take ``n`` nodes from the smallest sufficient buckets
upwards, so whole free nodes are kept for the jobs that need them (less
fragmentation).

:func:`shadow_time` replays the expected ends of running jobs node by node to
find when a blocked gang first fits (EASY backfill's reservation).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FreeIndex", "shadow_time", "MAX_GPUS_PER_NODE"]

#: largest GPU count per node that the index buckets (HGX/DGX boards have 8; 16 leaves room).
MAX_GPUS_PER_NODE = 16


class FreeIndex:
    """Free GPUs per node of one pool, indexed for best-fit.

    Args:
        free: free GPUs per node, int array ``(n_nodes,)``; copied.
        gpu_types: GPU type per node, sequence of str ``(n_nodes,)``.
        gpu_memory_gb: memory per GPU per node, float array ``(n_nodes,)``.
        healthy: optional bool array; unhealthy nodes receive no job.
    """

    __slots__ = ("free", "gpu_types", "mem", "_buckets", "_types", "total_free")

    def __init__(self, free, gpu_types, gpu_memory_gb, healthy=None):
        self.free = np.array(free, dtype=np.int64)
        self.gpu_types = list(gpu_types)
        self.mem = np.asarray(gpu_memory_gb, dtype=np.float64)
        self._types = sorted(set(self.gpu_types))
        self._buckets: dict[str, list[set[int]]] = {
            t: [set() for _ in range(MAX_GPUS_PER_NODE + 1)] for t in self._types
        }
        ok = np.ones(self.free.size, dtype=bool) if healthy is None else np.asarray(healthy, dtype=bool)
        self.total_free: dict[str, int] = {t: 0 for t in self._types}
        for i, (f, t) in enumerate(zip(self.free.tolist(), self.gpu_types)):
            if not ok[i]:
                self.free[i] = 0
                f = 0
            self._buckets[t][f].add(i)
            self.total_free[t] += f

    @property
    def types(self) -> list[str]:
        """GPU types present in this pool."""
        return self._types

    def max_free(self, gpu_type: str) -> int:
        """Largest number of free GPUs on one node of ``gpu_type`` (0 if none)."""
        b = self._buckets.get(gpu_type)
        if b is None:
            return 0
        for c in range(MAX_GPUS_PER_NODE, 0, -1):
            if b[c]:
                return c
        return 0

    def find(self, gpu_type: str, gpus_per_node: int, nodes: int, min_mem_gb: float = 0.0,
             exclude: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
        """Best-fit node indexes for a gang of ``nodes`` x ``gpus_per_node``, or None if it does not fit now.

        Nodes are distinct (one gang member per node). Nothing is changed;
        call :meth:`take` to allocate.
        """
        b = self._buckets.get(gpu_type)
        if b is None or gpus_per_node > MAX_GPUS_PER_NODE:
            return None
        if self.total_free[gpu_type] < gpus_per_node * nodes:
            return None
        chosen: list[int] = []
        for c in range(gpus_per_node, MAX_GPUS_PER_NODE + 1):
            bucket = b[c]
            if not bucket:
                continue
            for i in sorted(bucket) if len(bucket) < 64 else bucket:
                if i in exclude or self.mem[i] < min_mem_gb:
                    continue
                chosen.append(i)
                if len(chosen) == nodes:
                    return chosen
        return None

    def take(self, node_indexes: list[int], gpus_per_node: int) -> None:
        """Allocate ``gpus_per_node`` on each node. Raises ValueError on over-allocation."""
        for i in node_indexes:  # check the whole gang first: all or nothing
            f = int(self.free[i])
            if f < gpus_per_node:
                raise ValueError(f"node {i}: {gpus_per_node} GPUs requested, only {f} free")
        if len(set(node_indexes)) != len(node_indexes):
            raise ValueError(f"node_indexes={node_indexes}: a gang needs distinct nodes")
        for i in node_indexes:
            f = int(self.free[i])
            t = self.gpu_types[i]
            self._buckets[t][f].discard(i)
            self._buckets[t][f - gpus_per_node].add(i)
            self.free[i] = f - gpus_per_node
            self.total_free[t] -= gpus_per_node

    def give(self, node_index: int, gpus: int) -> None:
        """Return ``gpus`` GPUs to a node (a preempted or finished job)."""
        f = int(self.free[node_index])
        t = self.gpu_types[node_index]
        self._buckets[t][f].discard(node_index)
        self._buckets[t][f + gpus].add(node_index)
        self.free[node_index] = f + gpus
        self.total_free[t] += gpus


def shadow_time(index: FreeIndex, releases: list[tuple[float, int, int]], gpu_type: str,
                gpus_per_node: int, nodes: int, min_mem_gb: float, now_s: float) -> tuple[float, list[int] | None]:
    """Earliest instant a gang fits, assuming running jobs end when expected.

    Args:
        index: current free capacity (not modified).
        releases: ``(expected_end_s, node_index, gpus)`` for running jobs of this pool, sorted by time.
        gpu_type, gpus_per_node, nodes, min_mem_gb: the blocked gang.
        now_s: current instant, POSIX seconds.

    Returns:
        ``(t_s, node_indexes)``: the shadow time (POSIX s) and the nodes the gang
        would get then; ``(inf, None)`` if it never fits on this pool.
    """
    nodes_now = index.find(gpu_type, gpus_per_node, nodes, min_mem_gb)
    if nodes_now is not None:
        return now_s, nodes_now
    free = index.free.copy()
    eligible = np.array([t == gpu_type for t in index.gpu_types]) & (index.mem >= min_mem_gb)
    k = 0
    n = len(releases)
    while k < n:
        t = releases[k][0]
        while k < n and releases[k][0] <= t:
            _, i, g = releases[k]
            free[i] += g
            k += 1
        ok = eligible & (free >= gpus_per_node)
        if int(ok.sum()) >= nodes:
            cand = np.flatnonzero(ok)
            # best-fit at the shadow time: the fullest sufficient nodes first
            order = np.argsort(free[cand], kind="stable")
            return max(t, now_s), cand[order[:nodes]].tolist()
    return float("inf"), None
