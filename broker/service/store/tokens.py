"""Token and audit-log repository: the SQL of ``api_tokens`` and ``audit_events``.

The rules (kinds, lifetimes, who may manage what, the bootstrap rule) live in :mod:`broker.service.tokens`;
this module only reads and writes rows. Every function takes the :class:`~sqlalchemy.orm.Session` it runs
in, so a token change and its audit event share the caller's transaction.

* :class:`Principal` — who calls the API (a token's kind, team, node, public id, expiry);
* :func:`hash_token` — how a secret is stored (SHA-256 hex);
* audit: :func:`audit_row`, :func:`audit` (one event in a session), :func:`audit_event_rows`,
  :func:`purge_audit_events` (the reconciler's audit retention);
* tokens: :func:`add_token`, :func:`lock_tokens_for_bootstrap`, :func:`usable_admin_exists`, :func:`by_hash`,
  :func:`touch_last_used`, :func:`token_rows`, :func:`token_for_update`, :func:`node_token_rows`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from broker.service.store.tables import ApiToken, AuditEvent, utcnow

__all__ = ["Principal", "hash_token", "audit_row", "audit", "audit_event_rows", "purge_audit_events", "add_token",
           "lock_tokens_for_bootstrap", "usable_admin_exists", "by_hash", "touch_last_used", "token_rows",
           "token_for_update", "node_token_rows"]


@dataclass(frozen=True, init=False)
class Principal:
    """Who calls the API: a token's ``kind`` (:data:`broker.schemas.TOKEN_KINDS`), ``team``, ``node`` (node
    tokens), public ``token_id`` and ``expires_at`` (``None`` for a principal not made from a stored token).

    ``Principal(team, admin=True)`` still works and means ``kind="admin"``; :attr:`admin` is true for
    the broker admin kind (sees every team)."""

    team: str
    kind: str = "member"
    node: str | None = None
    token_id: str | None = None
    #: when the token stops working (UTC; ``None``: not a stored token)
    expires_at: datetime | None = None

    def __init__(self, team: str, admin: bool = False, *, kind: str | None = None, node: str | None = None,
                 token_id: str | None = None, expires_at: datetime | None = None):
        object.__setattr__(self, "team", team)
        object.__setattr__(self, "kind", kind or ("admin" if admin else "member"))
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "token_id", token_id)
        object.__setattr__(self, "expires_at", expires_at)

    @property
    def admin(self) -> bool:
        """Whether this is the broker admin (every team)."""
        return self.kind == "admin"

    @property
    def all_finance(self) -> bool:
        """Whether this principal reads every team's finance figures (usage, FOCUS, budgets): the broker admin
        and the ``finance`` viewer kind."""
        return self.kind in ("admin", "finance")


def hash_token(token: str) -> str:
    """SHA-256 hex digest of an API token (tokens are 256-bit random, so a fast hash is enough)."""
    return hashlib.sha256(token.encode()).hexdigest()


# ----------------------------------------------------------------------------- audit log
def audit_row(actor: Principal | None, action: str, target: str, detail: dict[str, Any] | None = None,
              now: datetime | None = None) -> dict[str, Any]:
    """The ``audit_events`` columns recording that ``actor`` (``None`` = direct store access, kind
    ``database``) did ``action`` to ``target`` at ``now`` (default: the current time, UTC); for bulk and
    driver-level inserts. ``detail`` must be JSON-serialisable."""
    who = ({"actor_token_id": None, "actor_team": "", "actor_kind": "database"} if actor is None else
           {"actor_token_id": actor.token_id, "actor_team": actor.team, "actor_kind": actor.kind})
    return {"at": now or utcnow(), "action": action, "target": target, "detail": detail or {}, **who}


def audit(s: Session, actor: Principal | None, action: str, target: str, detail: dict[str, Any] | None = None,
          now: datetime | None = None) -> None:
    """Inside session ``s`` (the transaction of the change): record that ``actor`` (``None`` = direct store
    access, kind ``database``) did ``action`` to ``target`` (one ``audit_events`` row, :func:`audit_row`)."""
    s.execute(insert(AuditEvent).values(**audit_row(actor, action, target, detail, now)))


def audit_event_rows(s: Session, since: datetime | None, limit: int, action: str | None) -> list[AuditEvent]:
    """Audit events newest first (by id): at or after ``since`` (aware; ``None`` = all), at most ``limit``,
    only ``action``'s when given."""
    q = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if since is not None:
        q = q.where(AuditEvent.at >= since)
    if action is not None:
        q = q.where(AuditEvent.action == action)
    return list(s.execute(q).scalars())


def purge_audit_events(s: Session, cutoff: datetime, limit: int) -> int:
    """Inside ``s``: delete up to ``limit`` audit events recorded before ``cutoff`` (``at < cutoff``, UTC;
    one at ``cutoff`` is kept), oldest first (by ``at``, then ``id``; the ``ix_audit_events_at`` index finds
    them). Rows another writer holds are skipped (``FOR UPDATE SKIP LOCKED``; PostgreSQL). Returns the rows
    deleted."""
    ids = select(AuditEvent.id).where(AuditEvent.at < cutoff).order_by(AuditEvent.at, AuditEvent.id) \
        .limit(int(limit)).with_for_update(skip_locked=True)
    return s.execute(delete(AuditEvent).where(AuditEvent.id.in_(ids.scalar_subquery()))).rowcount


# ----------------------------------------------------------------------------- tokens
def add_token(s: Session, *, public_id: str, team: str, kind: str, label: str, node: str | None, token_hash: str,
              created_at: datetime, expires_at: datetime) -> ApiToken:
    """Insert an unrevoked, never-used token row inside ``s`` (flushed, so its database id is set) and
    return it; ``admin`` is set for kind ``admin`` (the column older versions read)."""
    row = ApiToken(team=team, token_hash=token_hash, admin=kind == "admin", label=label, created_at=created_at,
                   revoked=False, public_id=public_id, kind=kind, node=node, expires_at=expires_at, last_used_at=None)
    s.add(row)
    s.flush()
    return row


def lock_tokens_for_bootstrap(s: Session) -> None:
    """Inside ``s``: keep other transactions from inserting tokens until ``s`` ends (PostgreSQL
    ``LOCK TABLE api_tokens IN SHARE ROW EXCLUSIVE MODE``; on SQLite ``BEGIN IMMEDIATE`` already serialises
    writers, so nothing is done)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("LOCK TABLE api_tokens IN SHARE ROW EXCLUSIVE MODE"))


def usable_admin_exists(s: Session, now: datetime) -> bool:
    """Whether an unrevoked admin token that has not expired at ``now`` is stored."""
    return s.execute(select(ApiToken.id).where(ApiToken.kind == "admin", ApiToken.revoked.is_(False),
                                               ApiToken.expires_at > now).limit(1)).first() is not None


def by_hash(s: Session, token_hash: str) -> Row | None:
    """The token stored with ``token_hash`` (:func:`hash_token`), revoked or not: a row with the named columns
    ``id, public_id, team, kind, node, revoked, expires_at, last_used_at``; ``None`` if there is none."""
    return s.execute(select(ApiToken.id, ApiToken.public_id, ApiToken.team, ApiToken.kind, ApiToken.node,
                            ApiToken.revoked, ApiToken.expires_at, ApiToken.last_used_at)
                     .where(ApiToken.token_hash == token_hash)).first()


def touch_last_used(s: Session, token_pk: int, now: datetime, stale: datetime) -> bool:
    """Set token ``token_pk``'s ``last_used_at`` to ``now`` only if it is unset or at or before ``stale`` (a
    conditional UPDATE: of many concurrent writers at most one writes). Returns whether it wrote."""
    res = s.execute(update(ApiToken).where(ApiToken.id == token_pk, ApiToken.last_used_at.is_(None)
                                           | (ApiToken.last_used_at <= stale)).values(last_used_at=now))
    return res.rowcount == 1


def token_rows(s: Session, team: str | None = None, kinds: Iterable[str] | None = None,
               include_revoked: bool = False) -> list[ApiToken]:
    """Token rows by team, then creation (then id): only ``team``'s and ``kinds`` when given; revoked ones
    only with ``include_revoked``."""
    q = select(ApiToken).order_by(ApiToken.team, ApiToken.created_at, ApiToken.id)
    if kinds is not None:
        q = q.where(ApiToken.kind.in_(sorted(kinds)))
    if team is not None:
        q = q.where(ApiToken.team == team)
    if not include_revoked:
        q = q.where(ApiToken.revoked.is_(False))
    return list(s.execute(q).scalars())


def token_for_update(s: Session, public_id: str) -> ApiToken | None:
    """The token row with public id ``public_id``, row-locked until ``s`` ends (``SELECT ... FOR UPDATE``), or
    ``None``."""
    return s.execute(select(ApiToken).where(ApiToken.public_id == public_id).with_for_update()).scalar_one_or_none()


def node_token_rows(s: Session, node: str, label: str) -> list[ApiToken]:
    """The unrevoked node tokens (kind ``node``) of ``node`` labelled ``label``."""
    return list(s.execute(select(ApiToken).where(ApiToken.kind == "node", ApiToken.node == node,
                                                 ApiToken.label == label, ApiToken.revoked.is_(False))).scalars())
