"""``fedbroker pools``: the pools of the cluster file, each with its kind, health and free GPUs by type.

::

    fedbroker pools [--config SETTINGS.yaml] [--json]

Agent pools (hosts running ``fedbroker serve agent``) are read from the job store (its nodes' heartbeats);
pools of an existing scheduler (``kind: slurm``) from their cluster, through their adapter: ``health`` is
``reachable`` or the typed error (``SchedulerUnavailable: ...``), ``backlog`` the GPUs the cluster's own pending
jobs ask for (:func:`broker.service.schedulers.pools_status`). Exits 2 for a bad settings or cluster file
(also a node GPU type or a pool ``carbon_zone``/``price_zone`` the planner cannot use: :func:`broker.sim.scenario.pool_problems`), 1 when the job store cannot be used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import JsonOpt, current_console, direct_store, echo_json, fail

__all__ = ["register", "pools"]


def _gpus(d: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in d.items()) or "-"


def pools(config: Optional[Path] = typer.Option(None, help="Settings YAML (default: $FEDBROKER_CONFIG)."),
          as_json: bool = JsonOpt) -> None:
    """List the pools of the cluster file: kind, health, free GPUs by type."""
    from broker.cluster import ClusterError, load_cluster
    from broker.service.live import LIVE_CLUSTER_PATH
    from broker.service.schedulers import pools_status
    from broker.sim.scenario import pool_problems

    with direct_store(config) as (settings, store):
        try:
            cluster = load_cluster(settings.cluster or LIVE_CLUSTER_PATH)
        except ClusterError as e:
            fail(str(e), 2)
        problems = pool_problems(cluster)  # the live broker would refuse the file (nothing to plan with)
        if problems:
            fail(f"{settings.cluster or LIVE_CLUSTER_PATH}: " + "; ".join(problems), 2)
        rows = pools_status(cluster, settings, store)
    if as_json:
        echo_json(rows)
        return
    tab = Table(title=f"{len(rows)} pool(s)")
    for col in ("pool", "kind", "health", "free GPUs", "total GPUs", "nodes", "backlog GPUs"):
        tab.add_column(col)
    for r in rows:
        health = r["health"] + "".join(f"; not planned: {why}" for why in r.get("not_planned", []))
        tab.add_row(escape(r["name"]), r["kind"], escape(health), _gpus(r["free_gpus"]), _gpus(r["total_gpus"]),
                    str(r["nodes"]), str(r["backlog_gpus"]) if "backlog_gpus" in r else "-")
    current_console().print(tab)


def register(app: typer.Typer) -> None:
    """Add ``pools`` to the ``fedbroker`` CLI."""
    app.command("pools")(pools)
