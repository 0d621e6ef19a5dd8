"""``fedbroker tokens`` (API tokens) and ``fedbroker audit`` (the broker's audit log).

Commands::

    fedbroker tokens create --team T [--kind K | --admin] [--label L] [--ttl 30d] [--node N] [--json]
    fedbroker tokens list [--team T] [--all] [--json]
    fedbroker tokens revoke TOKEN_ID [--json]
    fedbroker tokens rotate TOKEN_ID [--ttl 30d] [--json]
    fedbroker audit [--since T] [--action A] [--limit N] [--json]     (admin tokens)

``tokens create`` without a token writes to the job store directly (settings' database): only the
bootstrap on a fresh store (no admin token yet); with ``--token`` every token command uses the API.
Options and exit status as the job commands' (:mod:`broker.cli.jobs`).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.console import (JsonOpt, TokenOpt, UrlOpt, call, client, current_console, direct_store, echo_json, fail,
                                show, stderr, utc_text)

__all__ = ["tokens_app", "audit", "register"]

tokens_app = typer.Typer(no_args_is_help=True, help="API tokens: kinds, lifetimes, list, revoke, rotate "
                                                    "(over the API with --token; without one, only the bootstrap).")


@tokens_app.command("create")
def tokens_create(team: str = typer.Option(..., help="The team the token acts for."),
                  kind: str = typer.Option("member", "--kind",
                                           help="member | team-admin | read-only | node | admin | finance."),
                  admin: bool = typer.Option(False, "--admin", help="Same as --kind admin (sees every team)."),
                  label: str = typer.Option("", help="A note stored with the token."),
                  ttl: Optional[str] = typer.Option(None, "--ttl", help="Lifetime: 30d, 12h, 90m or seconds "
                                                                       "(default: settings' token_ttl_days)."),
                  node: Optional[str] = typer.Option(None, "--node", help="The node of a node token."),
                  config: Optional[Path] = typer.Option(None, help="Settings YAML (default: $FEDBROKER_CONFIG)."),
                  url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Create an API token and print its secret (once: only its hash is stored).

    With --token (or FEDBROKER_TOKEN) it asks the API: an admin token creates any kind for any team, a
    team-admin token member and read-only tokens of its own team. Without a token it writes to the job
    store directly, which works only while the store has no admin token (a fresh install: the bootstrap);
    afterwards use an admin token."""
    from broker.service.tokens import TOKEN_KINDS, InvalidTokenRequest, parse_ttl

    if admin:
        if kind not in ("member", "admin"):
            fail(f"--admin with --kind={kind!r}: give one of them", 2)
        kind = "admin"
    if kind not in TOKEN_KINDS:
        fail(f"--kind={kind!r}: one of {', '.join(TOKEN_KINDS)}", 2)
    try:
        ttl_s = parse_ttl(ttl) if ttl is not None else None
    except InvalidTokenRequest as e:
        fail(str(e).replace("ttl=", "--ttl=", 1), 2)
    if token:
        c = client(url, token)
        made = call(c, c.create_token, team=team, kind=kind, label=label,
                     ttl_s=int(ttl_s) if ttl_s is not None else None, node=node)
    else:
        made = _bootstrap_token(config, team, kind, label, ttl_s, node)
    _print_created(made, as_json)


@tokens_app.command("list")
def tokens_list(team: Optional[str] = typer.Option(None, help="Only this team (admins)."),
                include_revoked: bool = typer.Option(False, "--all", help="Also revoked tokens."),
                url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """List tokens (never their secrets): an admin token sees every team's, a team-admin token its own team's."""
    c = client(url, token)
    rows = call(c, c.tokens, team=team, include_revoked=include_revoked)

    def human(rows) -> None:
        tab = Table(show_edge=False)
        for col in ("id", "team", "kind", "label", "created", "expires", "last used", "state"):
            tab.add_column(col)
        for t in rows:
            state = "revoked" if t.revoked else "expired" if t.expired else "active"
            tab.add_row(t.id, escape(t.team), t.kind + (f" ({escape(t.node)})" if t.node else ""), escape(t.label),
                        utc_text(t.created_at), utc_text(t.expires_at), utc_text(t.last_used_at), state)
        current_console().print(tab)

    show(rows, as_json, human)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str = typer.Argument(..., help="tok-0123456789abcdef"),
                  url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Revoke a token: it answers 401 from now on."""
    c = client(url, token)
    t = call(c, c.revoke_token, token_id)
    show(t, as_json, lambda t: current_console().print(f"{t.id} revoked ({t.kind} of {t.team})", highlight=False))


@tokens_app.command("rotate")
def tokens_rotate(token_id: str = typer.Argument(..., help="tok-0123456789abcdef"),
                  ttl: Optional[str] = typer.Option(None, "--ttl", help="Lifetime of the new secret "
                                                                       "(default: settings' token_ttl_days)."),
                  url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """Replace a token by a new one (same kind, team and label, new expiry) and revoke the old one;
    prints the new secret (once)."""
    from broker.service.tokens import InvalidTokenRequest, parse_ttl

    try:
        ttl_s = parse_ttl(ttl) if ttl is not None else None
    except InvalidTokenRequest as e:
        fail(str(e).replace("ttl=", "--ttl=", 1), 2)
    c = client(url, token)
    _print_created(call(c, c.rotate_token, token_id, ttl_s=int(ttl_s) if ttl_s is not None else None), as_json)


def audit(since: Optional[str] = typer.Option(None, help="Only events at or after this instant (ISO 8601; "
                                                         "UTC if no offset)."),
          action: Optional[str] = typer.Option(None, help="Only this action, e.g. token.revoke, job.cancel."),
          limit: int = typer.Option(100, min=1, max=1000),
          url: Optional[str] = UrlOpt, token: Optional[str] = TokenOpt, as_json: bool = JsonOpt) -> None:
    """The broker's audit log, newest first (needs an admin token): token operations, submits, cancels
    and schedule changes, each with the acting token."""
    when = None
    if since is not None:
        try:
            when = datetime.fromisoformat(since.replace("Z", "+00:00"))
        except ValueError:
            fail(f"--since={since!r}: not an ISO 8601 instant (e.g. 2026-12-01T12:00:00Z)", 2)
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
    c = client(url, token)
    rows = call(c, c.audit, since=when, action=action, limit=limit)

    def human(rows) -> None:
        for e in rows:
            actor = f"{e.actor_kind}:{e.actor_team or '-'}:{e.actor_token_id or '-'}"
            current_console().print(escape(f"{utc_text(e.at)}  {e.action:<16} {e.target:<22} by {actor}  "
                                    f"{json.dumps(e.detail, sort_keys=True)}"), highlight=False)

    show(rows, as_json, human)


def _bootstrap_token(config: Path | None, team: str, kind: str, label: str, ttl_s: float | None, node: str | None):
    """Mint a token directly in the job store (:func:`broker.service.tokens.bootstrap`); exit 1 when refused, 2 for a bad
    field or settings file."""
    from broker.service.tokens import BootstrapRefused, InvalidTokenRequest, bootstrap

    with direct_store(config) as (settings, store):
        try:
            return bootstrap(store, team, kind, label=label, node=node,
                             ttl=ttl_s if ttl_s is not None else settings.token_ttl_days * 86400.0)
        except InvalidTokenRequest as e:
            fail(str(e), 2)
        except BootstrapRefused as e:
            fail(str(e), 1)


def _print_created(made, as_json: bool) -> None:
    """Print a just-created token: its secret alone on stdout (or the JSON), what it is on stderr."""
    if as_json:
        echo_json(made)
        return
    typer.echo(made.token)
    what = f"{made.kind} token {made.id} for team {made.team!r}" + (f" (node {made.node})" if made.node else "")
    stderr.print(escape(f"{what}, expires {utc_text(made.expires_at)}"
                      + (f", replaces {made.rotated_from} (now revoked)" if made.rotated_from else "")
                      + ": store it now, it is not shown again"), highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``tokens`` (``create``, ``list``, ``revoke``, ``rotate``) and ``audit`` to the ``fedbroker`` CLI."""
    app.add_typer(tokens_app, name="tokens")
    app.command("audit")(audit)
