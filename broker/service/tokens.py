"""API tokens: kinds, lifetimes, the bootstrap rule, and the audit log of who changed what.

Kinds (:data:`broker.schemas.TOKEN_KINDS`), each tied to one team::

    member      submit, read and cancel its team's jobs; its team's schedules
    team-admin  a member that also lists, creates (member, read-only), revokes and rotates
                its own team's member, read-only and team-admin tokens
    read-only   GET only, its own team (a team's own finance viewer)
    node        scoped to one node (``node``); no job or schedule route (the agent API will take it)
    admin       the broker admin: every team, every token operation, the audit log
    finance     the finance viewer of the whole broker: GET of the finance routes only
                (:data:`FINANCE_ROUTES`: usage summary, FOCUS export, budgets), every team's figures;
                no job, log, schedule, token, metrics or node route. Created by an admin only.

Every token has an expiry (``expires_at``, UTC; default lifetime ``settings.token_ttl_days``, at most
3650 days); an expired token answers 401 ``token expired``, an unknown or revoked one 401 ``unknown
or revoked token``. ``last_used_at`` is written at most once a minute per token (a conditional
UPDATE, so many API processes together still write at most once a minute).

Bootstrap: minting a token directly in the database (the CLI without ``--token``) works only while
the store holds no usable (unrevoked, unexpired) admin token — a fresh install. Afterwards every
token is minted over the API with an admin (or team-admin) token (:func:`bootstrap`).

Audit: every token operation and every job or schedule change requested through the API writes one
``audit_events`` row in the same transaction as the change (:func:`audit`): actor token id, team and
kind (``database`` for direct store access), action, target id and a JSON detail.

The rows are read and written by the store's repository :mod:`broker.service.store.tokens`; this module holds
the rules. Direct store access (the CLI, ``serve all``, tests): :func:`create_token`, :func:`create_node_token`,
:func:`principal_of` (``None`` instead of an error), :func:`node_of_token`.

Exceptions::

    broker.service.store.core.StoreError (ValueError)
     +-- TokenError
          +-- InvalidToken       401: unknown or revoked (also a malformed secret)
          |    +-- TokenExpired  401: past its expires_at
          +-- TokenNotFound      404: no token with this id visible to the caller
          +-- TokenForbidden     403: the caller's kind may not do this
          +-- TokenConflict      409: rotating a revoked token
          +-- BootstrapRefused   a usable admin token exists: mint over the API instead
          +-- InvalidTokenRequest  422: bad team, kind, node, label or lifetime; .field, .value
"""

from __future__ import annotations

import re
import secrets
import uuid
from datetime import datetime, timedelta
from typing import Any

from broker.model import TEAM_RE, TOKEN_ID_PATTERN, WEEK_S, line_problem, short_repr
from broker.schemas import TOKEN_KINDS, TOKEN_MAX_TTL_S, AuditEventView, CreatedToken, TokenView
from broker.service.store import tokens as repo
from broker.service.store.core import JobStore, StoreError
from broker.service.store.tables import ApiToken, utcnow
from broker.service.store.tokens import Principal, audit, audit_row, hash_token

__all__ = ["readable_team", "TOKEN_KINDS", "FINANCE_ROUTES", "finance_route", "NODE_TEAM", "revoke_node_tokens", "TOKEN_MAX_TTL_S", "TOKEN_MIN_TTL_S", "DEFAULT_TTL_S", "LAST_USED_RESOLUTION_S",
           "TOKEN_ID_RE", "TokenError", "InvalidToken", "TokenExpired", "TokenNotFound", "TokenForbidden",
           "TokenConflict", "BootstrapRefused", "InvalidTokenRequest", "parse_ttl", "new_token_id", "audit",
           "audit_row", "create_token", "create_node_token", "bootstrap", "authenticate", "principal_of",
           "node_of_token", "list_tokens", "revoke", "rotate", "audit_events", "may_manage", "MANAGED_BY_TEAM_ADMIN",
           "CREATED_BY_TEAM_ADMIN"]

#: the path prefixes a ``finance`` token may GET (every team's figures there): the usage summary and FOCUS export
#: (:mod:`broker.service.api_usage`) and the budget states (:mod:`broker.service.api_budgets`)
FINANCE_ROUTES = ("/v1/usage/", "/v1/budgets")


def finance_route(method: str, path: str) -> bool:
    """Whether a ``finance`` token may call ``method path``: a GET (or HEAD) of :data:`FINANCE_ROUTES`."""
    return method in ("GET", "HEAD") and (path.startswith("/v1/usage/") or path == "/v1/budgets"
                                          or path.startswith("/v1/budgets/"))


#: the shortest token lifetime, seconds
TOKEN_MIN_TTL_S = 60
#: the default lifetime when neither the caller nor the settings give one (settings.token_ttl_days' default)
DEFAULT_TTL_S = 90 * 86400
#: ``last_used_at`` is written at most once per this many seconds per token
LAST_USED_RESOLUTION_S = 60
#: public token ids
TOKEN_ID_RE = re.compile(TOKEN_ID_PATTERN)
#: kinds a team admin may create in its own team
CREATED_BY_TEAM_ADMIN = frozenset({"member", "read-only"})
#: kinds of its own team's tokens a team admin may list, revoke and rotate
MANAGED_BY_TEAM_ADMIN = frozenset({"member", "read-only", "team-admin"})
_NAME_RE = TEAM_RE  # team and node names: one rule (broker.model)
_TTL_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_TTL_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": WEEK_S}


class TokenError(StoreError):
    """Base of the token errors."""


class InvalidToken(TokenError):
    """The secret is unknown, malformed or revoked."""


class TokenExpired(InvalidToken):
    """The token's ``expires_at`` has passed."""


class TokenNotFound(TokenError):
    """No token with this id that the caller may see."""


class TokenForbidden(TokenError):
    """The caller's token kind may not do this."""


class TokenConflict(TokenError):
    """The operation does not fit the token's state (e.g. rotating a revoked token)."""


class BootstrapRefused(TokenError):
    """Direct-database minting while a usable admin token exists."""


class InvalidTokenRequest(TokenError):
    """A bad field of a token request; ``field`` and ``value`` name it, the message starts with ``field=value:``."""

    def __init__(self, field: str, value: Any, why: str):
        super().__init__(f"{field}={value!r}: {why}")
        self.field, self.value = field, value


#: the team recorded on node tokens (kind ``node``): they belong to a node, not a team, and no team route takes them
NODE_TEAM = "nodes"


def new_token_id() -> str:
    """A new public token id: ``tok-`` and 16 hex digits (64 random bits)."""
    return "tok-" + uuid.uuid4().hex[:16]


def _new_secret() -> str:
    return "fbk_" + secrets.token_urlsafe(32)


def parse_ttl(value: str | int | float | timedelta) -> float:
    """A token lifetime in seconds from ``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"``, ``"3600"`` (seconds),
    a number of seconds or a :class:`~datetime.timedelta`.

    Raises :class:`InvalidTokenRequest` (``ttl=...``) for anything else or a lifetime outside
    [60 s, 3650 days]."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _TTL_RE.match(value.lower())):
        seconds = float(m.group(1)) * _TTL_UNITS[m.group(2)]
    else:
        raise InvalidTokenRequest("ttl", value, "a lifetime such as 30d, 12h, 90m, 45s, 2w or a number of seconds")
    if not TOKEN_MIN_TTL_S <= seconds <= TOKEN_MAX_TTL_S:
        raise InvalidTokenRequest("ttl", value, f"must be between {TOKEN_MIN_TTL_S} s and "
                                                f"{TOKEN_MAX_TTL_S // 86400} days (got {seconds:g} s)")
    return seconds


def _view(r: ApiToken, now: datetime) -> TokenView:
    return TokenView(id=r.public_id, team=r.team, kind=r.kind, label=r.label, node=r.node, created_at=r.created_at,
                     expires_at=r.expires_at, last_used_at=r.last_used_at, revoked=bool(r.revoked),
                     expired=r.expires_at <= now)


def readable_team(who: Principal, team: str | None, sees_all: bool) -> str | None:
    """The team a read by ``who`` covers: ``team`` as asked (``None`` = every team) when ``sees_all`` (a broker
    admin; a finance token on the finance routes), else the caller's own team. Raises :class:`TokenForbidden`
    (403) when a caller who does not see all names another ``team``: the one rule of ``?team=`` on jobs,
    schedules, budgets and usage."""
    if sees_all:
        return team
    if team is not None and team != who.team:
        raise TokenForbidden(f"team={team!r}: your token belongs to team {who.team!r}")
    return who.team


def may_manage(actor: Principal, team: str, kind: str, *, create: bool = False) -> None:
    """Raise :class:`TokenForbidden` unless ``actor`` may create (``create``) or list/revoke/rotate a ``kind``
    token of ``team``: an admin any; a team admin its own team's (create: member and read-only; otherwise
    also team-admin); no other kind."""
    if actor.kind == "admin":
        return
    if actor.kind != "team-admin":
        raise TokenForbidden(f"a {actor.kind} token cannot manage tokens (needs a team-admin or admin token)")
    if team != actor.team:
        raise TokenForbidden(f"team={team!r}: your token is a team admin of {actor.team!r} only")
    allowed = CREATED_BY_TEAM_ADMIN if create else MANAGED_BY_TEAM_ADMIN
    if kind not in allowed:
        raise TokenForbidden(f"kind={kind!r}: a team admin may {'create' if create else 'manage'} only "
                             f"{', '.join(sorted(allowed))} tokens; ask a broker admin")


def _check_fields(team: str, kind: str, label: str, node: str | None) -> None:
    if not isinstance(team, str) or not _NAME_RE.match(team):
        raise InvalidTokenRequest("team", team, "1-63 letters, digits, '.', '_' or '-'")
    if kind not in TOKEN_KINDS:
        raise InvalidTokenRequest("kind", kind, f"one of {', '.join(TOKEN_KINDS)}")
    if len(label) > 200:
        raise InvalidTokenRequest("label", label[:20] + "...", "at most 200 characters")
    problem = line_problem(label)
    if problem is not None:  # shown by `fedbroker tokens list` (the rule of a job's name)
        raise InvalidTokenRequest("label", label[:40], problem)
    if kind == "node":
        if not node or not _NAME_RE.match(node):
            raise InvalidTokenRequest("node", node, "a node token needs the node's name (1-63 letters, digits, "
                                                    "'.', '_' or '-')")
    elif node is not None:
        raise InvalidTokenRequest("node", node, f"only node tokens name a node (kind is {kind!r})")


def _insert(s, team: str, kind: str, label: str, node: str | None, ttl_s: float, now: datetime
            ) -> tuple[str, ApiToken]:
    secret = _new_secret()
    row = repo.add_token(s, public_id=new_token_id(), team=team, kind=kind, label=label, node=node,
                         token_hash=hash_token(secret), created_at=now, expires_at=now + timedelta(seconds=ttl_s))
    return secret, row


def _created(secret: str, row: ApiToken, now: datetime, rotated_from: str | None = None) -> CreatedToken:
    return CreatedToken(**_view(row, now).model_dump(), token=secret, rotated_from=rotated_from)


def _detail(row: ApiToken) -> dict[str, Any]:
    return {"team": row.team, "kind": row.kind, "label": row.label, "node": row.node,
            "expires_at": row.expires_at.isoformat()}


def create_token(store: JobStore, team: str, kind: str = "member", *, label: str = "", ttl: Any = None,
                 node: str | None = None, actor: Principal | None = None, now: datetime | None = None
                 ) -> CreatedToken:
    """Create a token and audit it (``token.create``) in one transaction.

    Args:
        team, kind, label, node: see :class:`broker.schemas.TokenCreateRequest`.
        ttl: lifetime (:func:`parse_ttl`: seconds, ``"30d"``, a timedelta); ``None`` = :data:`DEFAULT_TTL_S`.
        actor: who asks; checked with :func:`may_manage` (``None`` = direct store access, unchecked); a team
            admin's token never makes one that outlives it (the lifetime is cut to its own expiry).
        now: aware creation instant (default: the current time).
    Returns: the token with its secret (shown once).
    Raises: :class:`InvalidTokenRequest`, :class:`TokenForbidden`.
    """
    now = now or utcnow()
    if kind == "node":
        team = NODE_TEAM  # a node token belongs to a node, not to a team
    _check_fields(team, kind, label, node)
    ttl_s = DEFAULT_TTL_S if ttl is None else parse_ttl(ttl)
    if actor is not None:
        may_manage(actor, team, kind, create=True)
        ttl_s = _within_actor(actor, ttl_s, now)
    with store.session() as s:
        secret, row = _insert(s, team, kind, label, node, ttl_s, now)
        audit(s, actor, "token.create", row.public_id, _detail(row), now)
    return _created(secret, row, now)


def _within_actor(actor: Principal, ttl_s: float, now: datetime, not_after: datetime | None = None) -> float:
    """The one lifetime cap (issue #9): ``ttl_s`` (seconds) cut so that a token made or rotated by a caller that
    is not a broker admin ends at most at the caller's own token's expiry and at most at ``not_after`` (a rotated
    token's current expiry: rotation replaces the secret, it never extends the lifetime). A broker admin's
    (``actor.kind == "admin"``) tokens are not cut. The answer's ``expires_at`` is the cut value.
    Returns the lifetime in seconds. Raises :class:`InvalidTokenRequest` (``ttl``) when less than
    :data:`TOKEN_MIN_TTL_S` would be left."""
    if actor.kind == "admin":
        return ttl_s
    if actor.expires_at is not None:
        left = (actor.expires_at - now).total_seconds()
        if left < TOKEN_MIN_TTL_S:
            raise InvalidTokenRequest("ttl", ttl_s, f"your own token expires in {max(left, 0):.0f} s: a token it "
                                                   f"makes would live less than {TOKEN_MIN_TTL_S} s; rotate yours first")
        ttl_s = min(ttl_s, left)
    if not_after is not None:
        left = (not_after - now).total_seconds()
        if left < TOKEN_MIN_TTL_S:
            raise InvalidTokenRequest("ttl", ttl_s, f"the token expires in {max(left, 0):.0f} s and rotation does "
                                                   f"not extend it (only a broker admin's does); create a new one")
        ttl_s = min(ttl_s, left)
    return ttl_s


def bootstrap(store: JobStore, team: str, kind: str = "member", *, label: str = "", ttl: Any = None,
              node: str | None = None, now: datetime | None = None) -> CreatedToken:
    """Mint a token directly in the database (no API token): only while the store holds no usable
    (unrevoked, unexpired) admin token, i.e. on a fresh install; audited as ``token.bootstrap`` with
    actor kind ``database``. The check and the insert are one transaction (PostgreSQL: the token table
    is locked against concurrent inserts; SQLite: ``BEGIN IMMEDIATE``), so two bootstraps cannot both pass.

    Arguments as :func:`create_token`. Raises :class:`BootstrapRefused` once an admin token exists,
    :class:`InvalidTokenRequest` for bad fields.
    """
    now = now or utcnow()
    _check_fields(team, kind, label, node)
    ttl_s = DEFAULT_TTL_S if ttl is None else parse_ttl(ttl)
    with store.session() as s:
        repo.lock_tokens_for_bootstrap(s)
        if repo.usable_admin_exists(s, now):
            raise BootstrapRefused(
                "this store already has an admin token, so tokens are no longer minted directly in the database: "
                "create them over the API with an admin (or team-admin) token, e.g. "
                "`fedbroker tokens create --team T --token $ADMIN_TOKEN` (or FEDBROKER_TOKEN)")
        secret, row = _insert(s, team, kind, label, node, ttl_s, now)
        audit(s, None, "token.bootstrap", row.public_id, _detail(row), now)
    return _created(secret, row, now)


def authenticate(store: JobStore, token: str, now: datetime | None = None) -> Principal:
    """The principal of a valid token: ``kind``, ``team``, ``node``, ``token_id``.

    Refreshes ``last_used_at`` when it is older than :data:`LAST_USED_RESOLUTION_S` (a conditional
    UPDATE: at most one write a minute per token, whatever the request rate or number of processes).
    Raises :class:`TokenExpired` (past ``expires_at``), :class:`InvalidToken` (unknown or revoked).
    """
    now = now or utcnow()
    if not isinstance(token, str) or not token or len(token) > 200:
        raise InvalidToken("unknown or revoked token")
    with store.session() as s:
        row = repo.by_hash(s, hash_token(token))
    if row is None or row.revoked:
        raise InvalidToken("unknown or revoked token")
    if row.expires_at <= now:
        raise TokenExpired(f"token expired at {row.expires_at.isoformat(timespec='seconds')} (token {row.public_id}); "
                           "ask for a new one or rotate it: `fedbroker tokens rotate TOKEN_ID`")
    stale = now - timedelta(seconds=LAST_USED_RESOLUTION_S)
    if row.last_used_at is None or row.last_used_at <= stale:
        with store.session() as s:
            repo.touch_last_used(s, row.id, now, stale)
    return Principal(row.team, kind=row.kind, node=row.node, token_id=row.public_id, expires_at=row.expires_at)


def principal_of(store: JobStore, token: str, now: datetime | None = None) -> Principal | None:
    """The principal of a valid (unrevoked, unexpired) token, else ``None`` (:func:`authenticate`, which
    tells expired from unknown, without the error)."""
    try:
        return authenticate(store, token, now)
    except InvalidToken:
        return None


def node_of_token(store: JobStore, token: str) -> str | None:
    """The node a valid (unrevoked, unexpired) node token names, else ``None`` (other kinds included)."""
    who = principal_of(store, token)
    return who.node if who is not None and who.kind == "node" else None


def create_node_token(store: JobStore, node: str, label: str = "", ttl: Any = None) -> str:
    """Create the credential of node ``node``'s agent (kind ``node``, team :data:`NODE_TEAM`) directly in the
    store and return its secret; audited ``token.create`` like every token (actor kind ``database``).
    ``ttl`` as :func:`create_token`. Raises :class:`InvalidTokenRequest` for a bad node name or lifetime."""
    return create_token(store, NODE_TEAM, "node", label=label, ttl=ttl, node=node).token


def list_tokens(store: JobStore, actor: Principal | None = None, team: str | None = None,
                include_revoked: bool = False, now: datetime | None = None) -> list[TokenView]:
    """Tokens by team, then creation: an admin (or ``actor=None``) sees every team's (or ``team``'s), a team
    admin its own team's member, read-only and team-admin tokens. Revoked ones only with ``include_revoked``.
    Raises :class:`TokenForbidden` (another kind, or a team admin naming another team)."""
    now = now or utcnow()
    kinds = None
    if actor is not None and actor.kind != "admin":
        may_manage(actor, team or actor.team, "member")
        team = actor.team
        kinds = MANAGED_BY_TEAM_ADMIN
    with store.session() as s:
        return [_view(r, now) for r in repo.token_rows(s, team, kinds, include_revoked)]


def _visible_row(s, token_id: str, actor: Principal | None) -> ApiToken:
    """The token row ``token_id`` for update, if ``actor`` may manage it; else :class:`TokenNotFound` (another
    team's token looks missing) or :class:`TokenForbidden` (own team, kind not allowed)."""
    missing = TokenNotFound(f"token_id={short_repr(token_id)}: no such token"
                            + ("" if actor is None or actor.kind == "admin" else f" for team {actor.team!r}"))
    if not isinstance(token_id, str) or not TOKEN_ID_RE.match(token_id):
        raise missing
    if actor is not None and actor.kind not in ("admin", "team-admin"):
        raise TokenForbidden(f"a {actor.kind} token cannot manage tokens (needs a team-admin or admin token)")
    row = repo.token_for_update(s, token_id)
    if row is None or (actor is not None and actor.kind != "admin" and row.team != actor.team):
        raise missing
    if actor is not None:
        may_manage(actor, row.team, row.kind)
    return row


def revoke(store: JobStore, token_id: str, actor: Principal | None = None, now: datetime | None = None) -> TokenView:
    """Revoke a token (it answers 401 from now on); audited ``token.revoke``. Revoking a revoked token changes
    nothing and writes no event. Raises :class:`TokenNotFound`, :class:`TokenForbidden`."""
    now = now or utcnow()
    with store.session() as s:
        row = _visible_row(s, token_id, actor)
        if not row.revoked:
            row.revoked = True
            s.flush()
            audit(s, actor, "token.revoke", row.public_id, _detail(row), now)
        return _view(row, now)


def revoke_node_tokens(store: JobStore, node: str, label: str, now: datetime | None = None) -> int:
    """Revoke every unrevoked node token of ``node`` labelled ``label`` (direct store access: ``serve all``
    replacing its local agent's token at each start); each audited ``token.revoke``. Returns how many."""
    now = now or utcnow()
    with store.session() as s:
        rows = repo.node_token_rows(s, node, label)
        for row in rows:
            row.revoked = True
            audit(s, None, "token.revoke", row.public_id, _detail(row), now)
    return len(rows)


def rotate(store: JobStore, token_id: str, actor: Principal | None = None, ttl: Any = None,
           now: datetime | None = None) -> CreatedToken:
    """Replace a token: a new secret and id with the same kind, team, label and node and a new expiry
    (``ttl``, default :data:`DEFAULT_TTL_S`); the old token is revoked in the same transaction (audited
    ``token.rotate`` on the old id, with the new id in the detail). A broker admin (or ``actor=None``, direct
    store access) may rotate an expired token and give any lifetime. A team admin rotates its own token, or
    member and read-only tokens of its team; the new token ends at most at the old token's expiry and at its own
    (:func:`_within_actor`; the answer's ``expires_at`` is the capped value): rotation replaces a secret, it
    never extends a lifetime.
    Raises :class:`TokenNotFound`, :class:`TokenForbidden`, :class:`TokenConflict` (already revoked),
    :class:`InvalidTokenRequest` (ttl)."""
    now = now or utcnow()
    ttl_s = DEFAULT_TTL_S if ttl is None else parse_ttl(ttl)
    with store.session() as s:
        old = _visible_row(s, token_id, actor)
        if old.revoked:
            raise TokenConflict(f"token_id={token_id!r}: revoked; a revoked token cannot be rotated, create a new one")
        if actor is not None and old.public_id != actor.token_id:
            # rotating yields a new secret: only of a kind the actor may create (a team admin rotates its own
            # token, never another team admin's)
            may_manage(actor, old.team, old.kind, create=True)
        if actor is not None:
            ttl_s = _within_actor(actor, ttl_s, now, not_after=old.expires_at)
        old.revoked = True
        secret, row = _insert(s, old.team, old.kind, old.label, old.node, ttl_s, now)
        audit(s, actor, "token.rotate", old.public_id, {**_detail(row), "new_token_id": row.public_id}, now)
    return _created(secret, row, now, rotated_from=old.public_id)


def audit_events(store: JobStore, since: datetime | None = None, limit: int = 100,
                 action: str | None = None) -> list[AuditEventView]:
    """Audit events newest first: at or after ``since`` (aware), at most ``limit`` (1-1000), optionally of one
    ``action``. Raises ``ValueError`` for a naive ``since`` or a ``limit`` out of range."""
    if since is not None and since.tzinfo is None:
        raise ValueError(f"since={since.isoformat()!r}: naive datetime; give an aware one (e.g. UTC)")
    if not 1 <= limit <= 1000:
        raise ValueError(f"limit={limit}: must be between 1 and 1000")
    with store.session() as s:
        return [AuditEventView(id=e.id, at=e.at, actor_token_id=e.actor_token_id, actor_team=e.actor_team,
                               actor_kind=e.actor_kind, action=e.action, target=e.target, detail=e.detail or {})
                for e in repo.audit_event_rows(s, since, limit, action)]
