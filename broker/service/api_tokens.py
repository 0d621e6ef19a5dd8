"""The token and audit routes of the HTTP API (added to :func:`broker.service.api.create_app`).

::

    GET  /v1/tokens?team=&include_revoked=   admin: every team's (or ``team``'s); team-admin: its own team's
    POST /v1/tokens                          TokenCreateRequest -> 201 CreatedToken (the secret, shown once)
    POST /v1/tokens/{token_id}/revoke        -> TokenView (revoking a revoked token is a no-op)
    POST /v1/tokens/{token_id}/rotate        TokenRotateRequest (optional) -> 201 CreatedToken (old one revoked)
    GET  /v1/audit?since=&action=&limit=     admin only -> list[AuditEventView], newest first

Permissions are :func:`broker.service.tokens.may_manage`: an admin creates any kind for any team; a team admin
creates ``member`` and ``read-only`` tokens of its own team and lists, revokes and rotates its own team's
member, read-only and team-admin tokens; every other kind gets 403. Another team's token answers 404
like a missing one. Errors: 403 (kind), 404 (token), 409 (rotating a revoked token), 422 naming the field.
"""

from datetime import datetime
from typing import Annotated

from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from broker.schemas import (AuditEventView, CreatedToken, ErrorBody, TokenCreateRequest, TokenRotateRequest,
                            TokenView)
from broker.service.api_usage import utc_param
from broker.service.settings import BrokerSettings
from broker.service.store.core import JobStore
from broker.service.tokens import (InvalidTokenRequest, TokenConflict, TokenForbidden, TokenNotFound, audit_events,
                           create_token, list_tokens, revoke, rotate)

__all__ = ["register"]

_ERR = {401: {"model": ErrorBody, "description": "missing, unknown, revoked or expired token"},
        403: {"model": ErrorBody, "description": "this token kind may not manage these tokens"}}
_ONE = {**_ERR, 404: {"model": ErrorBody, "description": "no such token visible to the caller"}}


def register(app: FastAPI, store: JobStore, settings: BrokerSettings, Caller) -> None:
    """Add the token and audit routes to ``app``; ``Caller`` is the API's authenticated-principal dependency
    (``Annotated[Principal, Depends(...)]``). Default lifetime: ``settings.token_ttl_days``."""

    def forget_cached() -> None:
        """Drop this process's cache of authenticated tokens (``create_app``'s token cache), so a token just
        revoked or rotated here answers 401 at once."""
        cache = getattr(app.state, "token_cache", None)
        if cache is not None:
            cache.clear()

    def default_ttl_s() -> float:
        return float(settings.token_ttl_days) * 86400.0

    @app.exception_handler(TokenNotFound)
    async def _not_found(request: Request, exc: TokenNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(TokenForbidden)
    async def _forbidden(request: Request, exc: TokenForbidden) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    @app.exception_handler(TokenConflict)
    async def _conflict(request: Request, exc: TokenConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    def unprocessable(e: InvalidTokenRequest) -> RequestValidationError:
        return RequestValidationError([{"type": "value_error", "loc": ("body", e.field), "input": e.value,
                                        "msg": str(e)}])

    @app.get("/v1/tokens", response_model=list[TokenView], tags=["tokens"], responses=_ERR)
    def get_tokens(who: Caller,
                   team: Annotated[str | None, Query(max_length=63, description="Only this team (admins)")] = None,
                   include_revoked: Annotated[bool, Query(description="Also revoked tokens")] = False
                   ) -> list[TokenView]:
        """Tokens by team, then creation (never their secrets): an admin sees every team's, a team admin its
        own team's member, read-only and team-admin tokens; other kinds 403."""
        return list_tokens(store, who, team=team, include_revoked=include_revoked)

    @app.post("/v1/tokens", status_code=201, response_model=CreatedToken, tags=["tokens"],
              responses={**_ERR, 422: {"model": ErrorBody, "description": "bad team, kind, node, label or ttl_s"}})
    def post_token(body: TokenCreateRequest, who: Caller) -> CreatedToken:
        """Create a token; the answer holds its secret (``token``), shown this once. ``team`` defaults to the
        caller's. An admin may create any kind for any team; a team admin only ``member`` and ``read-only``
        of its own team (403 otherwise)."""
        try:
            return create_token(store, body.team or who.team, body.kind, label=body.label, node=body.node,
                                ttl=body.ttl_s if body.ttl_s is not None else default_ttl_s(), actor=who)
        except InvalidTokenRequest as e:
            raise unprocessable(e) from None

    @app.post("/v1/tokens/{token_id}/revoke", response_model=TokenView, tags=["tokens"], responses=_ONE)
    def revoke_token(token_id: str, who: Caller) -> TokenView:
        """Revoke a token: it answers 401 from the next request on (on other API processes, within
        ``api_token_cache_s``). Revoking a revoked token is a no-op."""
        view = revoke(store, token_id, who)
        forget_cached()
        return view

    @app.post("/v1/tokens/{token_id}/rotate", status_code=201, response_model=CreatedToken, tags=["tokens"],
              responses={**_ONE, 409: {"model": ErrorBody, "description": "the token is revoked"}})
    def rotate_token(token_id: str, who: Caller,
                     body: Annotated[TokenRotateRequest | None, Body()] = None) -> CreatedToken:
        """Replace a token: a new id and secret (in the answer, once) with the same kind, team, label and node
        and a new expiry (``ttl_s``, default ``token_ttl_days``); the old token is revoked at once. Unless the
        caller is a broker admin, the expiry is capped at the old token's and at the caller's own (the answer's
        ``expires_at`` is the capped value); 422 (ttl_s) when under 60 s would be left."""
        ttl = body.ttl_s if body is not None and body.ttl_s is not None else default_ttl_s()
        try:
            created = rotate(store, token_id, who, ttl=ttl)
        except InvalidTokenRequest as e:
            raise unprocessable(e) from None
        forget_cached()
        return created

    @app.get("/v1/audit", response_model=list[AuditEventView], tags=["audit"], responses=_ERR)
    def get_audit(who: Caller,
                  since: Annotated[datetime | None, Query(description="Only events at or after this instant "
                                                                      "(ISO 8601 with an offset)")] = None,
                  action: Annotated[str | None, Query(max_length=40, description="Only this action, e.g. "
                                                                                 "token.revoke")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[AuditEventView]:
        """The audit log, newest first (admin tokens only): token operations, submits, cancels and schedule
        changes, each with its actor (token id, team, kind)."""
        if not who.admin:
            raise HTTPException(403, f"the audit log needs an admin token (yours is {who.kind} of {who.team!r})")
        if since is not None and since.tzinfo is None:
            raise RequestValidationError([{"type": "value_error", "loc": ("query", "since"), "input": str(since),
                                           "msg": f"since={since.isoformat()!r}: give an offset (e.g. Z or +00:00)"}])
        return audit_events(store, since=None if since is None else utc_param(since, "since"), limit=limit,
                            action=action)
