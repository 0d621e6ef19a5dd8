"""The node API: what a node agent may do, with a credential scoped to its own node.

Agents hold no broker secret (ARCHITECTURE.md §5, the Kubernetes kubelet/NodeRestriction model):
no database URL, no Redis, no admin token. They call these routes with
``Authorization: Bearer <node token>`` (``fedbroker nodes token HOST``), and every route acts
only on the caller's node and on the attempts placed on it; anything else answers 404
exactly like a missing attempt. A team token gets 401 here, and a node token gets 403 on
every team route (:func:`broker.service.api.create_app`'s principal)::

    GET  /v1/node/config               -> the agent-side settings (heartbeat interval, cancel grace, log chunking)
    POST /v1/node/heartbeat            NodeHeartbeat -> {"node": name}   (pool must be in the cluster file: 422)
    GET  /v1/node/work                 -> {"node": name, "work": [NodeWorkItem, ...]} and an ETag header
                                          (?wait_s= with If-None-Match: a long-poll, broker/service/work_watch.py)
    POST /v1/node/attempts/{job_id}/{attempt}/{rank}/running        -> {"changed": bool}
    POST /v1/node/attempts/{job_id}/{attempt}/{rank}/ended          NodeEnded -> {"recorded": bool, "changed": bool}
    POST /v1/node/attempts/{job_id}/{attempt}/{rank}/launch-failed  NodeReason -> {"changed": bool}
    POST /v1/node/attempts/{job_id}/{attempt}/{rank}/gone           -> {"changed": bool}
    POST /v1/node/attempts/{job_id}/{attempt}/{rank}/logs           NodeLogChunk -> {"stored": bool}

The state moves themselves live in :mod:`broker.service.attempts` (one home for the on-prem attempt
lifecycle); this module only authenticates, checks placement and validates bodies.
"""


import asyncio
import logging
import time
from typing import Annotated, Any, Callable

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.service import attempts
from broker.model import INT32_MAX, JOB_ID_PATTERN, MAX_NODES, LINE_PATTERN
from broker.service.store.core import JobStore, storable_text
from broker.service.service_endpoints import service_endpoints
from broker.service.tokens import node_of_token
from broker.service.work_watch import MAX_WAIT_S, WorkWatch, work_etag

__all__ = ["authenticate_node", "node_router"]

log = logging.getLogger("fedbroker.node_api")
_bearer = HTTPBearer(auto_error=False, description="A node token: `fedbroker nodes token HOST`.")
_ERRORS = {401: {"description": "missing token, or not a node token"},
           404: {"description": "no such attempt on this node"}}


#: the path parameters of an attempt's rank, bounded as the store keeps them
JobIdParam = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="job id (job-<16 hex digits>)")]
AttemptParam = Annotated[int, Path(ge=1, le=INT32_MAX, description="attempt number")]
RankParam = Annotated[int, Path(ge=0, le=MAX_NODES - 1, description="node rank")]


def authenticate_node(store: JobStore, token: str) -> str | None:
    """The node name a node token belongs to, or ``None`` (unknown, revoked, or a team/admin token).

    The ONE place node credentials are checked: a token of kind ``node`` (:mod:`broker.service.tokens`),
    unrevoked and unexpired."""
    if not token:
        return None
    return node_of_token(store, token)


class NodeHeartbeat(BaseModel):
    """A node's inventory and telemetry, as its agent read them from NVML."""

    model_config = ConfigDict(extra="forbid")
    pool: str = Field(min_length=1, max_length=63, pattern=LINE_PATTERN,
                      description="on-prem pool of the node (in the cluster file)")
    gpu_type: str = Field(min_length=1, max_length=32, pattern=LINE_PATTERN)
    gpu_count: int = Field(ge=0, le=64)
    gpu_memory_gb: float = Field(ge=0, le=10000)
    healthy_gpus: list[Annotated[int, Field(ge=0, le=63)]] = Field(
        max_length=64, description="indexes of the healthy GPUs: distinct, each below gpu_count")
    agent_id: str = Field(min_length=1, max_length=200, pattern=LINE_PATTERN)
    telemetry: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _healthy_within_count(self) -> "NodeHeartbeat":
        if len(set(self.healthy_gpus)) != len(self.healthy_gpus):
            raise ValueError(f"healthy_gpus={self.healthy_gpus!r}: an index appears twice")
        over = [g for g in self.healthy_gpus if g >= self.gpu_count]
        if over:
            raise ValueError(f"healthy_gpus={self.healthy_gpus!r}: {over} not below gpu_count={self.gpu_count}")
        return self


class NodeEnded(BaseModel):
    """The end of a rank: its exit code, or ``lost`` (the process is gone without one)."""

    model_config = ConfigDict(extra="forbid")
    exit_code: int | None = Field(None, ge=-255, le=255, description="None with lost=true")
    lost: bool = False
    stopped_why: str | None = Field(None, min_length=1, max_length=2000,
                                    description="the node stopped the rank itself, e.g. 'time limit of 60 s exceeded'")

    @field_validator("stopped_why")
    @classmethod
    def _storable_why(cls, v: str | None) -> str | None:
        return None if v is None else storable_text(v)


class NodeReason(BaseModel):
    """Why the node could not start a rank."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=2000)

    @field_validator("reason")
    @classmethod
    def _storable(cls, v: str) -> str:  # an OS error's text can hold a job's bytes
        return storable_text(v)


class NodeLogChunk(BaseModel):
    """One chunk of a rank's log; ``seq`` counts from 0 and a chunk already stored is ignored."""

    model_config = ConfigDict(extra="forbid")
    seq: int = Field(ge=0, le=10_000_000)
    text: str = Field(max_length=1024 * 1024)


def node_router(store: JobStore, settings, on_change: Callable[[str], None] | None = None) -> APIRouter:
    """The ``/v1/node`` routes over ``store``.

    Args:
        store: the job store.
        settings: :class:`broker.service.settings.BrokerSettings` (``max_attempts``, ``cluster`` and the
            agent-side settings served by ``/v1/node/config``).
        on_change: called with a job id after a report moved that job out of ``starting`` or
            ``running`` (the live broker wakes the planner with it); its errors are logged only.
    """
    router = APIRouter(prefix="/v1/node", tags=["node agents"])
    pools: set[str] = set()

    def known_pools() -> set[str]:
        if not pools:
            from broker.cluster import load_cluster
            from broker.service.live import LIVE_CLUSTER_PATH

            # agent pools only: a pool of an existing scheduler (kind: slurm) gets its nodes from its cluster
            pools.update(p.name for p in load_cluster(getattr(settings, "cluster", None) or LIVE_CLUSTER_PATH)
                         if not p.external)
        return pools

    def caller(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
        if creds is None or not creds.credentials:
            raise HTTPException(401, "missing token: send 'Authorization: Bearer <node token>' "
                                     "(create one with `fedbroker nodes token HOST`)",
                                headers={"WWW-Authenticate": "Bearer"})
        node = authenticate_node(store, creds.credentials)
        if node is None:
            raise HTTPException(401, "not a valid node token", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return node

    Node = Annotated[str, Depends(caller)]

    def placed(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, node: Node) -> str:
        if not attempts.placed_on(store, job_id, attempt, rank, node):
            raise HTTPException(404, f"job {job_id!r} attempt {attempt} rank {rank}: no such attempt on node {node!r}")
        return node

    Placed = Annotated[str, Depends(placed)]

    def changed(job_id: str, did: bool) -> None:
        if did and on_change is not None:
            try:
                on_change(job_id)
            except Exception:  # noqa: BLE001 - the report is stored; the planner runs on its timer anyway
                log.exception("on_change after a node report failed")

    max_attempts = getattr(settings, "max_attempts", None)

    @router.get("/config", responses=_ERRORS)
    def node_config(node: Node) -> dict:
        """The settings the agent works by, seconds and bytes: ``heartbeat_interval_s``,
        ``cancel_grace_s``, ``log_chunk_bytes``, ``log_max_bytes``, ``jobs`` (who jobs run as and
        where: :class:`broker.service.settings.JobsSettings`) and ``blocked_endpoints``: the broker's Redis and
        database and ``jobs.blocked_endpoints``, which the agent's jobs must not reach
        (:meth:`broker.service.service_endpoints.ServiceEndpoint.to_dict` each)."""
        jobs = settings.jobs
        return {"node": node, "heartbeat_interval_s": settings.heartbeat_interval_s,
                "cancel_grace_s": settings.cancel_grace_s, "log_chunk_bytes": settings.log_chunk_bytes,
                "log_max_bytes": settings.log_max_bytes,
                "jobs": {"user": jobs.user, "pool_users": dict(jobs.pool_users), "team_users": dict(jobs.team_users),
                         "root": None if jobs.root is None else str(jobs.root), "uid_range": list(jobs.uid_range)},
                "blocked_endpoints": [e.to_dict() for e in service_endpoints(settings)]}

    @router.post("/heartbeat", responses={**_ERRORS, 422: {"description": "unknown pool or bad field"}})
    def heartbeat(body: NodeHeartbeat, node: Node) -> dict:
        """Register or refresh the caller's node with its healthy GPUs and telemetry."""
        if body.pool not in known_pools():
            raise HTTPException(422, f"pool={body.pool!r}: not an agent pool of the cluster file "
                                     f"(known: {', '.join(sorted(known_pools()))})")
        store.heartbeat(node, body.pool, body.gpu_type, body.gpu_count, body.gpu_memory_gb, body.healthy_gpus,
                        body.agent_id, telemetry=body.telemetry)
        return {"node": node}

    watch = WorkWatch(store)

    @router.get("/work", response_model=None,
                responses={**_ERRORS, 200: {"description": "the node's work, with its ETag"},
                           304: {"description": "the work still matches If-None-Match after wait_s"}})
    async def work(node: Node,
                   wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description=(
                       "with If-None-Match: wait up to this many seconds for the work to change"))] = 0.0,
                   if_none_match: Annotated[str | None, Header(max_length=64, description=(
                       "the ETag of the work the agent has"))] = None) -> Response:
        """The ranks placed on the caller's node of every ``starting``/``running`` job (see
        :func:`broker.service.attempts.node_work`), with an ``ETag``. A long-poll: with ``If-None-Match`` equal
        to the current ETag and ``wait_s`` > 0 the answer waits until the node's work changes (200,
        seen within ~0.1 s) or ``wait_s`` passes (304); cost in :mod:`broker.service.work_watch`."""
        seen = await run_in_threadpool(watch.node_state, node) if wait_s > 0 and if_none_match else None
        items = await run_in_threadpool(attempts.node_work, store, node)
        tag = work_etag(items)
        end = time.monotonic() + wait_s
        while tag == if_none_match and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(watch.check_s, left))
            now = await run_in_threadpool(watch.node_state, node)
            if now != seen:
                seen = now
                items = await run_in_threadpool(attempts.node_work, store, node)
                tag = work_etag(items)
        if tag == if_none_match:
            return Response(status_code=304, headers={"ETag": tag})
        return JSONResponse({"node": node, "work": items}, headers={"ETag": tag})

    @router.post("/attempts/{job_id}/{attempt}/{rank}/running", responses=_ERRORS)
    def running(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, node: Placed) -> dict:
        """The rank's process started: ``starting -> running`` (idempotent)."""
        return {"changed": attempts.mark_running(store, job_id, attempt, node)}

    @router.post("/attempts/{job_id}/{attempt}/{rank}/ended", responses=_ERRORS)
    def ended(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, body: NodeEnded, node: Placed) -> dict:
        """The rank ended (exit code) or was lost (``lost: true``); ``recorded`` false: report again."""
        if body.lost == (body.exit_code is not None):
            raise HTTPException(422, f"exit_code={body.exit_code!r}, lost={body.lost!r}: "
                                     "give an exit code or lost=true, not both")
        recorded, did = attempts.report_end(store, job_id, attempt, rank, node, body.exit_code, max_attempts,
                                            body.stopped_why)
        changed(job_id, did)
        return {"recorded": recorded, "changed": did}

    @router.post("/attempts/{job_id}/{attempt}/{rank}/launch-failed", responses=_ERRORS)
    def launch_failed(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, body: NodeReason, node: Placed) -> dict:
        """The node could not start the rank: the attempt ends and the job is requeued."""
        did = attempts.launch_failed(store, job_id, attempt, node, body.reason, max_attempts)
        changed(job_id, did)
        return {"changed": did}

    @router.post("/attempts/{job_id}/{attempt}/{rank}/gone", responses=_ERRORS)
    def gone(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, node: Placed) -> dict:
        """The node has no process and no exit code for a rank the store shows running there."""
        did = attempts.process_gone(store, job_id, attempt, rank, node, max_attempts)
        changed(job_id, did)
        return {"changed": did}

    @router.post("/attempts/{job_id}/{attempt}/{rank}/logs", responses=_ERRORS)
    def logs(job_id: JobIdParam, attempt: AttemptParam, rank: RankParam, body: NodeLogChunk, node: Placed) -> dict:
        """Store one log chunk (idempotent by ``seq``); the attempt rank's stored log stays within
        ``log_max_bytes``, head and tail kept (:meth:`JobStore.append_log`), whatever the node sends."""
        return {"stored": store.append_log(job_id, attempt, rank, body.seq, body.text,
                                           max_bytes=settings.log_max_bytes)}

    return router
