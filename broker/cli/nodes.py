"""``fedbroker nodes``: the on-prem nodes, as the broker sees them and as NVML sees this host.

Commands::

    fedbroker nodes [--json]                      the nodes the broker knows (API), as ``nodes list``
    fedbroker nodes list [--json]                 GPUs, health, last heartbeat of every node (API)
    fedbroker nodes token HOST [--label L]        mint HOST's agent credential (store access via the settings;
                                                  printed once)
    fedbroker nodes probe [--nvml auto|nvml|fake] [--fake-gpus N] [--json]
                                                  this host's GPU inventory and telemetry, read the way the
                                                  node agent reads it (``providers.nvml.open_backend(...).read()``)

``list`` takes ``--url`` / ``--token`` like the job commands (exit 1 when the broker refuses or
cannot be reached). ``probe`` talks to no broker: ``--nvml nvml`` exits 2 with NVML's reason when
NVML cannot be used; ``--nvml auto`` falls back to the fake backend (the ``backend`` line says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import (JsonOpt, TokenOpt, UrlOpt, call, cell, client, current_console, direct_store, echo_json,
                                fail, utc_text)


__all__ = ["register", "nodes_app", "healthy_text"]

nodes_app = typer.Typer(help="On-prem nodes: `list` (what the broker knows; the default) and `probe` "
                             "(this host's GPUs through NVML).")


def healthy_text(healthy: Sequence[int], indices: Sequence[int]) -> str:
    """How many of a node's GPUs are healthy, as ``count/total healthy``, naming the GPUs that are not:
    ``healthy_text([0], [0]) == "1/1 healthy"``, ``healthy_text([0, 1, 3], range(4)) == "3/4 healthy, GPU 2 not"``,
    ``healthy_text([], [0, 1]) == "0/2 healthy"``. ``healthy`` and ``indices`` are NVML GPU indices (a bare
    index list read "0" for a healthy GPU 0, which looked like zero healthy GPUs)."""
    ok = set(healthy)
    bad = [i for i in indices if i not in ok]
    text = f"{len(ok & set(indices))}/{len(indices)} healthy"
    if bad and len(bad) < len(indices):
        text += f", GPU{'s' if len(bad) > 1 else ''} {','.join(map(str, bad))} not"
    return text


def _list(url: Optional[str], token: Optional[str], as_json: bool) -> None:
    c = client(url, token)
    ns = call(c, c.nodes)
    if as_json:
        echo_json(ns)
        return
    if ns and not hasattr(ns[0], "name"):  # a team token: the free capacity per pool and GPU type only
        cap = Table(title="on-prem capacity by pool and GPU type (admin tokens see each node)")
        for col in ("pool", "GPU type", "nodes up", "GPUs", "healthy", "free"):
            cap.add_column(col, justify="left" if col in ("pool", "GPU type") else "right")
        for c in ns:
            cap.add_row(escape(c.pool), escape(c.gpu_type), f"{c.nodes_up}/{c.nodes}", str(c.gpus),
                        str(c.healthy_gpus), str(c.free_gpus))
        current_console().print(cap)
        return
    tab = Table(title=f"{len(ns)} node(s)", show_edge=False)
    for col in ("name", "pool", "gpus", "health", "state", "last heartbeat"):
        tab.add_column(col, no_wrap=col in ("state", "last heartbeat"))  # the others shrink, cut with …
    for n in ns:
        tab.add_row(cell(n.name), cell(n.pool), cell(f"{n.gpu_count} x {n.gpu_type} {n.gpu_memory_gb:g} GB"),
                    cell(healthy_text(n.healthy_gpus, range(n.gpu_count))), n.state, utc_text(n.last_heartbeat_at))
    current_console().print(tab)


@nodes_app.callback(invoke_without_command=True)
def nodes(ctx: typer.Context, url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt,
          as_json: bool = JsonOpt) -> None:
    """List the on-prem nodes: GPUs, health, last heartbeat (same as `nodes list`)."""
    if ctx.invoked_subcommand is None:
        _list(url, token, as_json)


@nodes_app.command("list")
def nodes_list(url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """List the on-prem nodes: GPUs, health, last heartbeat."""
    _list(url, token, as_json)


#: below this console width ``nodes probe`` leaves out the GPU UUID column (``--json`` has it)
PROBE_WIDE_AT = 120


def cuda_version(v: int | None) -> str | None:
    """NVML's CUDA driver version integer as text: ``12040`` -> ``"12.4"``; ``None`` stays ``None``."""
    if v is None:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def _opt(v, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


@nodes_app.command("probe")
def probe(nvml: str = typer.Option("auto", "--nvml", help="auto (NVML, else a fake), nvml (NVML or exit 2) or fake."),
          fake_gpus: int = typer.Option(4, "--fake-gpus", help="GPUs of the fake backend."),
          as_json: bool = JsonOpt) -> None:
    """This host's GPUs as the node agent reads them: inventory and telemetry per GPU."""
    from providers.nvml import BACKEND_KINDS, NvmlUnavailable, open_backend

    if nvml not in BACKEND_KINDS:
        fail(f"--nvml={nvml!r}: one of {', '.join(BACKEND_KINDS)}", 2)
    if fake_gpus < 0 or fake_gpus > 1024:
        fail(f"--fake-gpus={fake_gpus}: must be between 0 and 1024", 2)
    try:
        backend = open_backend(nvml, fake_gpus=fake_gpus)
    except NvmlUnavailable as e:
        fail(f"--nvml=nvml: NVML is not available here: {e}", 2)
    try:
        inv = backend.read()
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - nvmlShutdown failing changes nothing read
                pass
    if as_json:
        d = inv.to_dict()
        d["cuda_version"] = cuda_version(inv.cuda_driver_version)
        for g in d["gpus"]:
            g["energy_j"] = None if g["energy_mj"] is None else g["energy_mj"] / 1000
        echo_json(d)
        return
    con = current_console()
    con.print(f"backend {inv.backend}; driver {inv.driver_version or '-'}; "
              f"CUDA {cuda_version(inv.cuda_driver_version) or '-'}; {len(inv.gpus)} GPU(s); "
              f"type {inv.gpu_type or 'unknown'}; {healthy_text(inv.healthy_indices, [g.index for g in inv.gpus])}",
              highlight=False)
    # below PROBE_WIDE_AT columns the UUIDs (in --json) are left out; numbers are never cut, names and errors are
    shown = [c for c in ("#", "name", "uuid", "memory MiB", "util %", "power W", "energy J", "temp C", "MIG", "ECC",
                         "health") if con.width >= PROBE_WIDE_AT or c != "uuid"]
    tab = Table(title=f"{len(inv.gpus)} GPU(s), backend {inv.backend}", show_edge=False)
    for col in shown:
        tab.add_column(col, no_wrap=col not in ("name", "uuid", "health"),
                       justify="right" if col in ("#", "memory MiB", "util %", "power W", "energy J",
                                                  "temp C", "ECC") else "left")
    for g in inv.gpus:
        mem = ("-" if g.memory_total_mib is None
               else f"{_opt(g.memory_used_mib)}/{g.memory_total_mib}")
        mig = "-" if g.mig_mode is None else (f"on ({g.mig_instances})" if g.mig_mode else "off")
        health = "healthy" if g.healthy else f"error: {g.error or 'unknown'}"
        row = {"#": str(g.index), "name": cell(g.name), "uuid": cell(g.uuid), "memory MiB": mem,
               "util %": _opt(g.utilisation_pct, "{:g}"), "power W": _opt(g.power_w, "{:g}"),
               "energy J": _opt(None if g.energy_mj is None else g.energy_mj / 1000, "{:.1f}"),
               "temp C": _opt(g.temperature_c, "{:g}"), "MIG": mig, "ECC": _opt(g.ecc_uncorrected),
               "health": cell(health)}
        tab.add_row(*(row[c] for c in shown))
    con.print(tab)


@nodes_app.command("token")
def node_token(node: str = typer.Argument(..., help="The node (host) name the token is for."),
               label: str = typer.Option("", help="A note stored with the token."),
               config: Optional[Path] = typer.Option(None, help="Settings YAML (default: $FEDBROKER_CONFIG).")) -> None:
    """Mint a node token for HOST's agent and print it once (only its hash is stored). Talks to the
    job store directly (run it where the broker's settings are, never on the agent host); the agent
    takes it as ``FEDBROKER_NODE_TOKEN`` or ``--token-file`` (mode 0600)."""
    from broker.service.tokens import InvalidTokenRequest, create_node_token

    with direct_store(config) as (_, store):
        try:
            tok = create_node_token(store, node, label=label)
        except InvalidTokenRequest as e:
            fail(str(e), 2)
    typer.echo(tok)
    typer.echo(f"node token for {node!r}: store it now (chmod 600), it is not shown again", err=True)


def register(app: typer.Typer) -> None:
    """Add ``nodes`` (``list``, ``token``, ``probe``) to the ``fedbroker`` CLI."""
    app.add_typer(nodes_app, name="nodes")
