"""The cloud side of the live broker: provision a placed job's instances, hear from them, watch them, tear them down.

Flow of a cloud attempt (DESIGN.md §2 and §5)::

    planner: queued -> provisioning (placement = the chosen offer)          broker.service.cycle
    fedbroker.provision: CloudBroker.provision(job, attempt)                here
        failover options: the chosen offer, then zone -> instance type -> region -> provider
        per rank: intent row (cloud_instances, state "intent") BEFORE the create call, tagged instance,
        idempotency token from (job, attempt, offer, rank); rank 0 first, the others get its private
        address as MASTER_ADDR; all or nothing (providers.provisioner.provision_gang)
        -> starting (placement.nodes = [{rank, instance_id, zone, private_ip}])
        or  -> queued (every option failed; the failover history is on the attempt)
    instance user data (providers.launch.cloud_init) reports to POST /v1/instances/report:
        running -> job running; notice (spot/preemption) -> stop_reason "spot";
        exited(code) -> succeeded / failed / requeued from its checkpoint        CloudBroker.report
        (all or nothing: a rank that fails or is stopped by a notice stops the others by shutting their
        instances down - SIGTERM, checkpoint, upload, report - and the attempt ends when every rank has
        reported, or ``stop_window`` after the first stop)
    reconciler (CloudBroker.watch, every pass):
        cancel requested -> instances terminated, job cancelled;
        an instance of an active attempt gone (spot reclaimed, lost) -> every instance of the attempt
        terminated, job requeued from its checkpoint (all or nothing);
        instance rows of attempts that are no longer live -> terminated;
        every ``sweep_interval_s``: instances tagged with our broker id but no live attempt -> terminated.

Offers that just failed (no capacity, quota, an outage), were reclaimed (spot) or never started are not offered
to the planner again for a while (:meth:`CloudBroker.cooldown_s`, :meth:`CloudBroker.cooling_offers`). An
attempt that created nothing does not count against ``max_attempts``: the cooldown is the back-off.

A job stopped by a spot notice is requeued whatever its exit code: exit 0 after SIGTERM usually means
"checkpointed", not "finished" (the on-prem agent treats a preempted job the same way).

Instances authenticate their reports with a per-(job, attempt, rank) token: HMAC-SHA256 of
``job|attempt|rank`` under a random key kept in the database (:meth:`broker.service.store.core.JobStore.instance_secret`).
It only lets an instance report on its own rank of its own attempt.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update

from broker.service.store.tables import Attempt, CloudInstance, Job, JobEvent, utcnow
from broker.planner.core import smallest_fit
from broker.service.lifecycle import requeue_lost
from broker.states import JobState
from broker.service.store.core import JobStore
from providers.base import Compute, FailoverHistory, InstanceInfo, InstanceRequest, ProviderError, idempotency_token

__all__ = ["build_computes", "offer_allowed", "failover_options", "CloudBroker", "report_token", "ReportError",
           "REPORT_EVENTS", "CLOUD_ACTIVE_STATES"]

log = logging.getLogger("fedbroker.cloud")
S = JobState
#: events an instance reports (see providers.launch.cloud_init)
REPORT_EVENTS = ("running", "notice", "exited")
#: cloud_instances states whose instance may still exist
LIVE_ROW_STATES = ("intent", "running", "terminating")
#: job states in which a cloud attempt holds instances
CLOUD_ACTIVE_STATES = (S.provisioning.value, S.starting.value, S.running.value)
#: bytes of an instance's exit report log tail kept
LOG_TAIL_MAX = 65536
#: seconds after its creation during which an instance the provider does not find is not taken as gone
NOT_FOUND_GRACE_S = 120.0


class ReportError(ValueError):
    """A report that cannot be taken: ``status`` 401 (bad token), 404 (no such instance), 422 (bad field)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def report_token(secret: bytes, job_id: str, attempt: int, rank: int) -> str:
    """The report token of one rank of one attempt: 43 URL-safe characters (HMAC-SHA256, base64url)."""
    import base64

    mac = hmac.new(secret, f"{job_id}|{attempt}|{rank}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def build_computes(settings) -> dict[str, Compute]:
    """Provider adapters for ``settings.cloud_providers``, configured from the ``aws`` / ``gcp`` sections."""
    out: dict[str, Compute] = {}
    if "aws" in settings.cloud_providers:
        from providers.aws import AwsCompute

        a = settings.aws
        out["aws"] = AwsCompute(
            endpoint_url=a.endpoint_url, regions=sorted(a.regions),
            ami_by_region={r: c.ami_id for r, c in a.regions.items()},
            security_group_by_region={r: c.security_group_id for r, c in a.regions.items() if c.security_group_id},
            subnet_by_zone={z: sub for c in a.regions.values()
                            for z, sub in {**c.subnet_ids_by_az, **c.subnet_ids_by_az_id}.items()},
            region_by_zone={z: r for r, c in a.regions.items() for z in {**c.subnet_ids_by_az, **c.subnet_ids_by_az_id}},
            key_name=a.key_name,
            placement_group_by_region={r: c.placement_group_name for r, c in a.regions.items()
                                       if c.placement_group_name},
            instance_profile_by_region={r: c.instance_profile_name for r, c in a.regions.items()
                                        if c.instance_profile_name},
            launch_template_by_region={r: c.launch_template_id for r, c in a.regions.items() if c.launch_template_id})
    if "gcp" in settings.cloud_providers:
        from providers.gcp import GcpCompute

        g = settings.gcp
        kw = {}
        if g.api_endpoint:
            from google.auth.credentials import AnonymousCredentials

            kw = {"api_endpoint": g.api_endpoint, "credentials": AnonymousCredentials()}
        out["gcp"] = GcpCompute(g.project, image=g.gpu_image, network=g.network, subnetwork=g.subnetwork,
                                service_account=g.service_account_email, op_timeout_s=g.operation_timeout_s, **kw)
    return out


def offer_allowed(settings, offer) -> bool:
    """May ``offer`` (a ``CloudOffer``) be provisioned: its provider is in ``cloud_providers`` and its zone
    is one the provider's settings have a network for (AWS: a subnet in ``subnet_ids_by_az`` or
    ``subnet_ids_by_az_id``; GCP: a zone of
    ``gcp.region``)."""
    if offer.provider not in settings.cloud_providers:
        return False
    if offer.provider == "aws":
        reg = settings.aws.regions.get(offer.region)
        return reg is not None and (offer.zone in reg.subnet_ids_by_az or offer.zone in reg.subnet_ids_by_az_id)
    if offer.provider == "gcp":
        return offer.region == settings.gcp.region
    return False


def failover_options(offers: Iterable, chosen_id: str, spec: dict, allowed: Callable[[object], bool],
                     cooling: set[str] = frozenset(), limit: int = 8, canon: Callable[[str], str] = str) -> list:
    """The options one cloud attempt tries, in order: the planner's choice, then zone -> instance type ->
    region -> provider (DESIGN.md §5), each group cheapest first per GPU-hour.

    ``offers``: every ``CloudOffer``; ``spec``: the job spec (dict). An option must hold the job the way
    the planner's ``compatible_offers`` does (GPU type in ``gpu_types``, ``gpu_count == gpus_per_node`` for a
    gang, else between ``gpus_per_node`` and :func:`broker.planner.core.smallest_fit` of it; memory, spot only if ``spot_allowed``, ``allowed_regions``, ``max_price_usd_per_hour``
    for all nodes), be ``allowed`` and not ``cooling`` (the chosen offer is always first when allowed).
    At most ``limit`` options."""
    offers = list(offers)
    by_id = {o.offer_id: o for o in offers}
    chosen = by_id.get(chosen_id)
    types = {canon(t) for t in spec.get("gpu_types") or ()}
    regions = set(spec.get("allowed_regions") or ())
    gpn, nodes = int(spec["gpus_per_node"]), int(spec["nodes"])
    cap = spec.get("max_price_usd_per_hour")

    def fits(o) -> bool:
        market = getattr(o.market, "value", o.market)
        if types and canon(o.gpu_type) not in types:
            return False
        if (o.gpu_count != gpn) if nodes > 1 else not gpn <= o.gpu_count <= smallest_fit(gpn):
            return False
        if o.gpu_memory_gb < float(spec.get("min_gpu_memory_gb") or 0.0):
            return False
        if market == "spot" and not spec.get("spot_allowed", True):
            return False
        if regions and o.region not in regions:
            return False
        if cap is not None and o.usd_per_hour * nodes > float(cap):
            return False
        return allowed(o)

    out = [chosen] if chosen is not None and allowed(chosen) else []
    rest = [o for o in offers if o.offer_id != chosen_id and o.offer_id not in cooling and fits(o)]
    if chosen is not None:
        cm = getattr(chosen.market, "value", chosen.market)
        rest.sort(key=lambda o: (o.provider != chosen.provider, o.region != chosen.region,
                                 o.instance_type != chosen.instance_type, getattr(o.market, "value", o.market) != cm,
                                 o.usd_per_hour / o.gpu_count, o.offer_id))
    else:
        rest.sort(key=lambda o: (o.usd_per_hour / o.gpu_count, o.offer_id))
    return (out + rest)[:limit]


@dataclass
class _Launch:
    """What ``provision`` read of the job before calling providers (no session is held across those calls)."""

    job_id: str
    attempt: int
    team: str
    spec: dict
    offer_id: str


class CloudBroker:
    """Provisioning, reports, watching and sweeping of cloud instances (see the module docstring).

    Args:
        store: the job store.
        settings: :class:`broker.service.settings.BrokerSettings` (``cloud``, ``aws``, ``gcp``, ``max_attempts``).
        offers: every ``CloudOffer`` the planner knows (failover options are taken from them).
        computes: provider name -> adapter; default :func:`build_computes` (settings).
        teardown: ``teardown(job_id, attempt)`` asks for an attempt's instances to be terminated soon
            (a Celery task in the broker); default: terminate here and now.
        canon: canonical GPU type names (default ``pricing.power.canonical_or_same``).
        sleep: for throttling back-off (tests pass a recorder).
    """

    def __init__(self, store: JobStore, settings, offers: Iterable = (), computes: dict[str, Compute] | None = None,
                 teardown: Callable[[str, int], None] | None = None, canon: Callable[[str], str] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.settings = settings
        self.offers = list(offers)
        self.computes = build_computes(settings) if computes is None else computes
        self._teardown_cb = teardown
        from pricing.power import canonical_or_same

        self.canon = canon or canonical_or_same
        self.sleep = sleep
        self._secret: bytes | None = None
        self._last_poll: dict[str, float] = {}
        host = (urlsplit(settings.effective_report_url).hostname or "").lower()
        if settings.cloud_providers and (host in ("localhost", "0.0.0.0", "::", "::1") or host.startswith("127.")):
            log.warning("cloud instances report to %s, a local address they cannot reach: set cloud.report_url to "
                        "an address of this broker's API reachable from the instances' subnets",
                        settings.effective_report_url)
        self._last_sweep = float("-inf")

    # ------------------------------------------------------------------ tokens
    @property
    def secret(self) -> bytes:
        """The key of the report tokens (32 bytes, from the database; read once per process)."""
        if self._secret is None:
            self._secret = self.store.instance_secret()
        return self._secret

    def token(self, job_id: str, attempt: int, rank: int) -> str:
        """The report token of one rank of one attempt (see :func:`report_token`)."""
        return report_token(self.secret, job_id, attempt, rank)

    # ------------------------------------------------------------------ cooldown
    def cooldown_s(self, error: str | None) -> float:
        """Seconds an offer is not chosen again after an instance record with ``error`` (``"Class: message"``):
        ``capacity_cooldown_s`` after no capacity, a spot reclaim or a start timeout; ``quota_cooldown_s`` after a
        quota error or an option the provider does not support; ``error_cooldown_s`` after any other provider
        error (an outage); 0 for anything else (a plain teardown)."""
        c = self.settings.cloud
        kind = (error or "").split(":", 1)[0]
        if kind in ("NoCapacity", "Reclaimed", "StartTimeout"):
            return c.capacity_cooldown_s
        if kind in ("QuotaExceeded", "Unsupported"):
            return c.quota_cooldown_s
        if kind in ("ProviderError", "Throttled"):
            return c.error_cooldown_s
        return 0.0

    def cooling_offers(self, s, now: datetime) -> set[str]:
        """Offer ids not to choose now (inside session ``s``): an instance record of the offer failed or was
        lost within its cooldown (:meth:`cooldown_s`). The planner and the failover walk both skip them."""
        c = self.settings.cloud
        since = now - timedelta(seconds=max(c.capacity_cooldown_s, c.quota_cooldown_s, c.error_cooldown_s))
        out = set()
        for offer_id, err, at in s.execute(select(CloudInstance.offer_id, CloudInstance.error, CloudInstance.updated_at)
                                           .where(CloudInstance.error.is_not(None), CloudInstance.updated_at >= since)):
            if (now - at).total_seconds() <= self.cooldown_s(err):
                out.add(offer_id)
        return out

    @staticmethod
    def mark_attempt(s, job_id: str, attempt: int, error: str, now: datetime | None = None) -> None:
        """Inside session ``s``: record ``error`` (``"Reclaimed: ..."``, ``"StartTimeout: ..."``) on every instance
        record of the attempt, so its offer cools down (:meth:`cooling_offers`) from ``now``; the teardown keeps it."""
        now = now or utcnow()
        for row in s.execute(select(CloudInstance).where(CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
                                                         CloudInstance.provider_instance_id.is_not(None))).scalars():
            row.error, row.updated_at = error[:2000], now

    # ------------------------------------------------------------------ provisioning
    def provision(self, job_id: str, attempt: int, now: datetime | None = None) -> str:
        """Create every instance of a ``provisioning`` job's attempt, or put the job back in the queue.

        Idempotent: a second call for the same attempt finds the instances by their tokens; a call for a
        job no longer ``provisioning`` with that attempt returns ``"stale"``. Returns a short outcome."""
        from providers.launch import cloud_init, launch_spec
        from providers.provisioner import ProvisioningFailed, provision_gang

        now = now or utcnow()
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is None or j.state != S.provisioning.value or j.attempt != attempt:
                return "stale"
            if j.cancel_requested:
                JobStore.cas(s, j.id, j.version, S.provisioning.value, S.cancelled.value,
                             "cancelled by user before its instances were created", now, finished_at=now)
                return "cancelled"
            job = _Launch(j.id, attempt, j.team, dict(j.spec), (j.placement or {}).get("offer_id", ""))
            if JobStore.attempt_row(s, j.id, attempt) is None:
                s.add(Attempt(job_id=j.id, number=attempt, kind="cloud", pool=None, offer_id=job.offer_id, nodes=[],
                              gpu_type=(j.placement or {}).get("gpu_type"),
                              gpus=int(j.spec["gpus_per_node"]) * int(j.spec["nodes"]), created_at=now,
                              rank_exits={}, reason="", failover=[]))
            cooling = self.cooling_offers(s, now)
        from broker.model import JobSpec

        spec = JobSpec.model_validate(job.spec)
        options = failover_options(self.offers, job.offer_id, job.spec, lambda o: offer_allowed(self.settings, o),
                                   cooling, self.settings.cloud.max_failover_options, self.canon)
        history = FailoverHistory()
        c = self.settings.cloud

        def user_data(option, rank: int, master_ip: str | None) -> str:
            provider = option.provider
            section = getattr(self.settings, provider)
            uri = section.checkpoint_uri
            if uri:
                uri = f"{uri.rstrip('/')}/{spec.team}/{job.job_id}"
            ls = launch_spec(spec, job.job_id, attempt, rank, spec.nodes, master_ip or "127.0.0.1",
                             checkpoint_root=c.checkpoint_root, grace_s=c.notice_grace_s)
            return cloud_init(ls, provider, report_url=self.settings.effective_report_url,
                              report_token=self.token(job.job_id, attempt, rank), checkpoint_uri=uri,
                              master_addr_at_boot=rank == 0, checkpoint_sync_s=c.checkpoint_sync_s)

        def failed_gang(option, made: list[tuple[int, InstanceInfo]]) -> None:
            # provision_gang terminates them next; a failed terminate is left to the sweep (tagged, not live)
            with self.store.session() as s:
                for rank, inst in made:
                    row = s.execute(select(CloudInstance).where(CloudInstance.idempotency_token == idempotency_token(
                        job.job_id, attempt, option.offer_id, rank))).scalar_one_or_none()
                    if row is not None:
                        row.provider_instance_id, row.private_ip = inst.instance_id, inst.private_ip
                        row.state, row.updated_at = "terminated", now
                        row.error = "another rank of the gang could not be created on this option"

        try:
            if not options:
                raise ProvisioningFailed(f"{job_id} attempt {attempt}: no allowed cloud option holds the job "
                                         f"(offer {job.offer_id!r} is not configured or cooling down)", history)
            option, instances = provision_gang(
                job.job_id, attempt, job.team, spec.nodes, options, self.computes, user_data,
                c.broker_id, history, lambda req: self._record_intent(req, now), on_failed_gang=failed_gang,
                sleep=self.sleep)
        except ProvisioningFailed as exc:
            self._record_failures(job.job_id, attempt, history)
            with self.store.session() as s:
                self._save_history(s, job.job_id, attempt, history, ended=now, outcome="unprovisioned",
                                   reason=str(exc))
                j = s.get(Job, job.job_id)
                if j is None or j.state != S.provisioning.value or j.attempt != attempt:
                    return "stale"
                tried = "; ".join(f"{a.option}: {a.error} ({a.message[:120]})" for a in history.attempts
                                  if a.error) or str(exc)
                # nothing ran: not counted against max_attempts; the failed offers cool down instead, so the
                # planner does not pick them again at once (a provider outage backs off, it does not fail jobs)
                requeue_lost(s, j, now, f"cloud provisioning failed: {tried}", outcome="unprovisioned",
                             max_attempts=None)
            return "requeued"
        self._record_failures(job.job_id, attempt, history)
        parts = [{"rank": r, "instance_id": i.instance_id, "zone": i.zone, "private_ip": i.private_ip,
                  "node": f"{option.provider}/{i.instance_id}"} for r, i in enumerate(instances)]
        ok = False
        with self.store.session() as s:
            for r, inst in enumerate(instances):
                row = s.execute(select(CloudInstance).where(
                    CloudInstance.job_id == job.job_id, CloudInstance.attempt == attempt, CloudInstance.rank == r,
                    CloudInstance.offer_id == option.offer_id)).scalar_one_or_none()
                if row is not None:
                    row.provider_instance_id, row.private_ip = inst.instance_id, inst.private_ip
                    row.state, row.updated_at = "running", now
            self._save_history(s, job.job_id, attempt, history, offer_id=option.offer_id, nodes=parts)
            j = s.get(Job, job.job_id)
            if j is not None and j.state == S.provisioning.value and j.attempt == attempt and not j.cancel_requested:
                placement = {"kind": "cloud", "provider": option.provider, "offer_id": option.offer_id,
                             "region": option.region, "zone": option.zone, "instance_type": option.instance_type,
                             "market": getattr(option.market, "value", option.market), "gpu_type": option.gpu_type,
                             "nodes": parts}
                where = ", ".join(f"rank {p['rank']} {p['instance_id']} ({p['private_ip'] or 'no address yet'})"
                                  for p in parts)
                ok = JobStore.cas(s, j.id, j.version, S.provisioning.value, S.starting.value,
                                  f"instances created on {option.offer_id}: {where}", now, placement=placement,
                                  dispatched_at=now, state_deadline_at=now + timedelta(seconds=c.start_deadline_s))
        if not ok:  # cancelled or timed out meanwhile: nothing may keep running
            self.teardown(job.job_id, attempt, "the job left provisioning while its instances were created")
            return "stale"
        return f"starting on {option.offer_id} ({len(instances)} instance(s))"

    def _record_intent(self, req: InstanceRequest, now: datetime) -> None:
        """The intent record of one create call (idempotent on the request's token)."""
        with self.store.session() as s:
            row = s.execute(select(CloudInstance).where(CloudInstance.idempotency_token == req.token)
                            ).scalar_one_or_none()
            if row is None:
                provider = req.offer_id.split(":", 1)[0]
                s.add(CloudInstance(job_id=req.job_id, attempt=req.attempt, rank=req.rank, offer_id=req.offer_id,
                                    provider=provider, region=req.region, zone=req.zone,
                                    instance_type=req.instance_type, market=req.market,
                                    idempotency_token=req.token, state="intent", created_at=now, updated_at=now,
                                    history=[]))
            elif row.state == "failed":  # the same option tried again (a later attempt cannot share the token)
                row.state, row.updated_at = "intent", now

    def _record_failures(self, job_id: str, attempt: int, history: FailoverHistory) -> None:
        """Intent rows of (option, rank) tries that failed get state ``failed`` and the error (the cooldown reads
        them); a try that was retried and then worked (throttling) is not a failure."""
        last: dict[tuple[str, int | None], object] = {}
        for a in history.attempts:
            last[(a.option, a.rank)] = a
        failed = {k: a for k, a in last.items() if a.error}
        if not failed:
            return
        now = utcnow()
        with self.store.session() as s:
            rows = s.execute(select(CloudInstance).where(
                CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
                CloudInstance.offer_id.in_(list({o for o, _ in failed})))).scalars().all()
            for row in rows:
                a = failed.get((row.offer_id, row.rank)) or failed.get((row.offer_id, None))
                if a is not None and row.state == "intent" and row.provider_instance_id is None:
                    row.state, row.error, row.updated_at = "failed", f"{a.error}: {a.message}"[:2000], now
                    row.history = [*(row.history or []), {"at": a.at, "error": a.error, "message": a.message}]

    def _save_history(self, s, job_id: str, attempt: int, history: FailoverHistory, ended: datetime | None = None,
                      outcome: str | None = None, reason: str | None = None, offer_id: str | None = None,
                      nodes: list | None = None) -> None:
        att = JobStore.attempt_row(s, job_id, attempt)
        if att is None:
            return
        att.failover = [*(att.failover or []), *history.to_json()]
        if offer_id is not None:
            att.offer_id = offer_id
        if nodes is not None:
            att.nodes = nodes
        if ended is not None and att.ended_at is None:
            att.ended_at, att.outcome, att.reason = ended, outcome, reason or ""

    # ------------------------------------------------------------------ reports
    def check_token(self, job_id: str, attempt: int, rank: int, token: str) -> bool:
        """Whether ``token`` is the report token of that rank of that attempt (constant-time compare)."""
        return hmac.compare_digest(self.token(job_id, attempt, rank).encode(), (token or "").encode())

    def report(self, job_id: str, attempt: int, rank: int, event: str, exit_code: int | None = None,
               reason: str = "", log_tail: str = "", now: datetime | None = None, seq: int | None = None) -> str:
        """Take one instance report (the token was checked by the caller). Returns the outcome; asks for the
        attempt's instances to be torn down when the attempt has ended. Raises :class:`ReportError` (404 for an
        unknown rank of the attempt, 422 for an unknown event).

        ``seq``: the report's sequence number (the instance's user data counts its reports from 1). A report
        whose ``seq`` is not above the highest one taken from this rank's instance is a replay (or a retry of
        a report that was taken): it changes nothing, appends no log, and the outcome is ``"duplicate"``.
        ``None`` (in-process callers) skips the check."""
        if event not in REPORT_EVENTS:
            raise ReportError(422, f"event={event!r}: must be one of {', '.join(REPORT_EVENTS)}")
        now = now or utcnow()
        ended = False
        stop_ranks: list[int] = []
        out = "ok"
        claimed = seq is None
        for _ in range(10):
            with self.store.session() as s:
                row = s.execute(select(CloudInstance).where(
                    CloudInstance.job_id == job_id, CloudInstance.attempt == attempt, CloudInstance.rank == rank,
                    CloudInstance.provider_instance_id.is_not(None)).order_by(CloudInstance.id.desc())).scalars().first()
                if row is None:
                    raise ReportError(404, f"no instance of job {job_id} attempt {attempt} rank {rank}")
                j = s.get(Job, job_id)
                att = JobStore.attempt_row(s, job_id, attempt, lock=True)
                if j is None or att is None:
                    raise ReportError(404, f"no attempt {attempt} of job {job_id}")
                if not claimed:  # one atomic compare-and-set: two copies of one report cannot both pass
                    claimed = s.execute(update(CloudInstance).where(
                        CloudInstance.id == row.id,
                        or_(CloudInstance.report_seq.is_(None), CloudInstance.report_seq < seq)
                    ).values(report_seq=seq)).rowcount == 1
                    if not claimed:
                        log.warning("instance report of job %s attempt %s rank %s: seq %s already taken; "
                                    "a replay or a retry, ignored", job_id, attempt, rank, seq)
                        return "duplicate"
                where = f"rank {rank} on {row.provider}/{row.provider_instance_id}"
                if j.attempt != attempt or j.state not in (S.starting.value, S.running.value):
                    ended = True  # a stale report changes nothing, but its instance must go
                    out = "stale"
                    break
                row.last_report_at, row.last_event = now, event
                if event == "notice" and (j.placement or {}).get("market") != "spot":
                    out = "ignored: a notice from an instance that is not spot"
                    break
                if j.state == S.starting.value and event in ("running", "exited"):
                    if not JobStore.cas(s, j.id, j.version, S.starting.value, S.running.value, f"running ({where})",
                                        now, started_at=j.started_at or now, state_deadline_at=None):
                        continue
                    s.refresh(j)
                    if att.started_at is None:
                        att.started_at = now
                if event == "running":
                    out = "running"
                    break
                if event == "notice":
                    if not j.stop_reason and not j.cancel_requested:
                        why = (f"spot interruption notice for {where}" + (f" ({reason})" if reason else "")
                               + "; the job checkpoints and stops")
                        version = j.version
                        if not JobStore.bump(s, j.id, version, now, stop_reason="spot", reason=why,
                                             state_deadline_at=now + self.stop_window):
                            continue
                        s.add(JobEvent(job_id=j.id, at=now, from_state=j.state, to_state=j.state,
                                       version=version + 1, reason=why))
                        self.mark_attempt(s, job_id, attempt, f"Reclaimed: {why}", now)
                    out = "notice"
                    break
                # exited
                exits = dict(att.rank_exits or {})
                exits[str(rank)] = exit_code if exit_code is not None else "lost"
                att.rank_exits = exits
                nranks = len((j.placement or {}).get("nodes", [])) or 1
                failed = exit_code is None or exit_code != 0
                if len(exits) < nranks and not j.cancel_requested:
                    if not failed and not j.stop_reason:
                        out = "rank done"
                        break
                    # all or nothing: stop the other ranks first (their instances are shut down: SIGTERM, they
                    # checkpoint, push and report), and end the attempt when every rank has ended
                    if not j.stop_reason and isinstance(exits[str(rank)], int):
                        att.exit_code = exit_code  # the failing rank's code is the job's
                    if not j.stop_reason or j.state_deadline_at is None or len(exits) == 1:  # the first to end
                        why = (f"{where} ended ({exits[str(rank)]}); stopping the other ranks" if not j.stop_reason
                               else f"{where} ended after the spot notice; stopping the other ranks")
                        version = j.version
                        if not JobStore.bump(s, j.id, version, now, stop_reason=j.stop_reason or "peer-ended",
                                             reason=why, state_deadline_at=j.state_deadline_at or now + self.stop_window):
                            continue
                        s.add(JobEvent(job_id=j.id, at=now, from_state=j.state, to_state=j.state,
                                       version=version + 1, reason=why))
                    stop_ranks = [r for r in range(nranks) if str(r) not in exits]
                    out = "stopping the other ranks"
                    break
                ok, out = self._end_attempt(s, j, att, now, exit_code, exits, where)
                if ok:
                    ended = True
                    break
        if event == "exited" and log_tail:  # after the sequence check: a replayed exit appends nothing
            self.store.append_log(job_id, attempt, rank, 0, "[fedbroker: the last bytes of the container's log, "
                                  "sent by the instance when it exited]\n" + log_tail[-LOG_TAIL_MAX:])
        if ended:
            self.request_teardown(job_id, attempt)
        elif stop_ranks:
            self.teardown(job_id, attempt, "stopped: another rank of the gang ended", ranks=stop_ranks)
        return out

    @property
    def stop_window(self) -> timedelta:
        """How long the other ranks of a stopping gang have to checkpoint and report before the attempt is ended
        without them: the container's grace plus 3 minutes (an instance's shutdown, the checkpoint upload)."""
        return timedelta(seconds=self.settings.cloud.notice_grace_s + 180.0)

    def _end_attempt(self, s, j: Job, att: Attempt, now: datetime, code: int | None, exits: dict,
                     where: str) -> tuple[bool, str]:
        """End a running cloud attempt from an exit report: the job's outcome (inside session ``s``). After a
        failed rank stopped the gang (``peer-ended``) the job fails with that rank's exit code, not with the
        stopped ranks' 143."""
        if j.stop_reason == "peer-ended" and att.exit_code is not None:
            code = att.exit_code
        att.ended_at = now
        att.exit_code = code
        if j.cancel_requested:
            att.outcome = "cancelled"
            return JobStore.cas(s, j.id, j.version, S.running.value, S.cancelled.value,
                                "cancelled by user; instances terminated", now, finished_at=now, exit_code=code), "cancelled"
        if j.stop_reason in ("spot", "preempt") or code is None:
            att.outcome = "interrupted"
            why = "spot interruption" if j.stop_reason == "spot" else f"{where} ended without an exit code"
            return requeue_lost(s, j, now, why, "interrupted",
                                max_attempts=None if j.stop_reason == "spot" else self.settings.max_attempts), "requeued"
        if all(v == 0 for v in exits.values()) and len(exits) >= (len((j.placement or {}).get("nodes", [])) or 1):
            att.outcome = "succeeded"
            return JobStore.cas(s, j.id, j.version, S.running.value, S.succeeded.value, "exit code 0", now,
                                finished_at=now, exit_code=0), "succeeded"
        att.outcome = "failed"
        bad = {r: c for r, c in exits.items() if c != 0}
        return JobStore.cas(s, j.id, j.version, S.running.value, S.failed.value,
                            f"exit code {code} ({where})" if len(exits) == 1 else f"ranks ended with {bad}",
                            now, finished_at=now, exit_code=code), "failed"

    # ------------------------------------------------------------------ teardown
    def request_teardown(self, job_id: str, attempt: int) -> None:
        """Ask for the attempt's instances to be terminated (the ``teardown`` callback, else now)."""
        if self._teardown_cb is not None:
            try:
                self._teardown_cb(job_id, attempt)
                return
            except Exception:  # the reconciler terminates rows of dead attempts anyway
                log.exception("could not request the teardown of %s attempt %d; terminating here", job_id, attempt)
        self.teardown(job_id, attempt, "the attempt ended")

    def teardown(self, job_id: str, attempt: int, why: str = "the attempt ended", ranks: list[int] | None = None) -> int:
        """Terminate every instance of ``(job_id, attempt)`` (only those of ``ranks`` if given) that may still
        exist; returns how many were asked. A provider error leaves the row ``terminating`` (the reconciler tries
        again once the attempt has ended)."""
        with self.store.session() as s:
            rows = [(r.id, r.provider, r.provider_instance_id, r.zone) for r in s.execute(select(CloudInstance).where(
                CloudInstance.job_id == job_id, CloudInstance.attempt == attempt,
                CloudInstance.state.in_(LIVE_ROW_STATES))).scalars() if ranks is None or r.rank in ranks]
        n = 0
        for row_id, provider, instance_id, zone in rows:
            state, err = "terminated", why
            if instance_id is not None:
                compute = self.computes.get(provider)
                try:
                    if compute is None:
                        raise ProviderError(f"no adapter for provider {provider!r}")
                    compute.terminate(instance_id, zone)
                    n += 1
                except ProviderError as exc:
                    state, err = "terminating", f"{why}; terminate failed: {exc}"
                    log.warning("terminate %s/%s failed: %s", provider, instance_id, exc)
            else:
                state = "abandoned"  # no id known: if the create went through, the sweep finds it by its tags
            with self.store.session() as s:
                r = s.get(CloudInstance, row_id)
                if r is not None and r.state in LIVE_ROW_STATES:
                    keep = self.cooldown_s(r.error) > 0 and state == "terminated"  # why its offer cools down (and since when)
                    r.state = state
                    if not keep:
                        r.error, r.updated_at = err[:2000], utcnow()
        return n

    # ------------------------------------------------------------------ watching (reconciler)
    def live_attempts(self, s) -> set[tuple[str, int]]:
        """``(job, attempt)`` of every job whose current attempt may hold instances."""
        return {(jid, att) for jid, att in s.execute(select(Job.id, Job.attempt).where(
            Job.state.in_(CLOUD_ACTIVE_STATES)))}

    def watch(self, now: datetime | None = None, force: bool = False) -> dict:
        """One reconciler step for cloud attempts (see the module docstring). ``force`` ignores the poll and
        sweep intervals. Returns counts: ``cancelled``, ``lost`` (attempts requeued because an instance is gone
        or a rank never reported), ``stale_terminated`` (instances of dead attempts), ``swept`` (orphans),
        ``changed``, and ``listed`` (provider list calls made to poll the attempts' instances).

        Cost per pass: a few database queries whatever the number of jobs; per provider due for a poll, ONE
        listing of this broker's instances (``list_managed``: paginated ``DescribeInstances`` with a tag filter,
        a GCE aggregated list), then a ``describe`` only for an instance missing from it (to tell a spot
        reclaim from a loss). Polling each instance on its own would make 1000s of calls a minute at scale,
        and the clouds throttle that."""
        now = now or utcnow()
        c = self.settings.cloud
        out = {"cancelled": 0, "lost": 0, "stale_terminated": 0, "swept": 0, "listed": 0}
        mono = time.monotonic()
        with self.store.session() as s:
            jobs = [(j.id, j.attempt, j.state, j.cancel_requested, dict(j.placement or {}), j.dispatched_at,
                     j.state == S.running.value and j.stop_reason is not None)
                    for j in s.execute(select(Job).where(Job.state.in_([S.starting.value, S.running.value])))
                    .scalars() if (j.placement or {}).get("kind") == "cloud"]
            silent = self._silent_ranks(s, now)
        due: list[tuple[str, int, dict, datetime | None]] = []
        for job_id, attempt, state, cancel, pl, dispatched, stopping in jobs:
            if cancel:
                out["cancelled"] += self._cancel(job_id, attempt, state, now)
                continue
            if (job_id, attempt) in silent:
                out["lost"] += self._requeue_silent(job_id, attempt, silent[(job_id, attempt)], now)
                continue
            if stopping:
                out["lost"] += self._end_stopping(job_id, attempt, now)
                continue
            if force or mono - self._last_poll.get(job_id, float("-inf")) >= c.poll_interval_s:
                self._last_poll[job_id] = mono
                due.append((job_id, attempt, pl, dispatched))
        listings: dict[str, dict[str, InstanceInfo] | None] = {}
        for job_id, attempt, pl, dispatched in due:
            provider = pl.get("provider", "")
            if provider not in listings:
                listings[provider] = self._listing(provider)
                out["listed"] += listings[provider] is not None
            gone = self._gone_instance(pl, listings[provider], now, dispatched)
            if gone is None:
                continue
            with self.store.session() as s:
                j = s.get(Job, job_id)
                if j is not None and j.attempt == attempt and j.state in (S.starting.value, S.running.value):
                    spot = j.stop_reason == "spot" or gone[1]
                    why = (f"instance {gone[0]} was reclaimed (spot interruption)" if spot
                           else f"instance {gone[0]} is gone ({gone[2]})") + "; all ranks stopped"
                    if spot:
                        self.mark_attempt(s, job_id, attempt, f"Reclaimed: {why}", now)
                    out["lost"] += requeue_lost(s, j, now, why, "interrupted",
                                                max_attempts=None if spot else self.settings.max_attempts)
            self.teardown(job_id, attempt, "another instance of the gang is gone")
        live = {j[0] for j in jobs}
        for job_id in [k for k in self._last_poll if k not in live]:
            del self._last_poll[job_id]
        out["stale_terminated"] = self._terminate_dead_rows()
        if force or mono - self._last_sweep >= c.sweep_interval_s:
            self._last_sweep = mono
            out["swept"] = len(self.sweep())
        out["changed"] = out["cancelled"] + out["lost"]
        return out

    def _cancel(self, job_id: str, attempt: int, state: str, now: datetime) -> int:
        """A cancel requested on a starting/running cloud job: cancelled, instances terminated."""
        n = 0
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is not None and j.attempt == attempt and j.state == state:
                att = JobStore.attempt_row(s, job_id, attempt)
                if att is not None and att.ended_at is None:
                    att.ended_at, att.outcome, att.reason = now, "cancelled", "cancelled by user"
                n = JobStore.cas(s, j.id, j.version, state, S.cancelled.value, "cancelled by user; instances terminated",
                                 now, finished_at=now)
        self.teardown(job_id, attempt, "the job was cancelled")
        return n

    def _end_stopping(self, job_id: str, attempt: int, now: datetime) -> int:
        """A gang being stopped (a rank ended, or a spot notice) is not polled: its ranks report as they stop.
        Once ``stop_window`` has passed without every report, the attempt ends with what it has: requeued after
        a spot notice (from its checkpoint), failed after a failed rank. Returns 1 if it ended here."""
        n = 0
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if (j is None or j.attempt != attempt or j.state != S.running.value or j.state_deadline_at is None
                    or j.state_deadline_at > now):
                return 0
            att = JobStore.attempt_row(s, job_id, attempt, lock=True)
            if att is None:
                return 0
            exits = dict(att.rank_exits or {})
            nranks = len((j.placement or {}).get("nodes", [])) or 1
            for r in range(nranks):
                exits.setdefault(str(r), "lost")
            att.rank_exits = exits
            ok, _ = self._end_attempt(s, j, att, now, None if j.stop_reason == "spot" else att.exit_code, exits,
                                      f"ranks that did not report within {self.stop_window.total_seconds():.0f} s")
            n = int(ok)
        self.teardown(job_id, attempt, "the gang's stop window passed")
        return n

    def _silent_ranks(self, s, now: datetime) -> dict[tuple[str, int], list[int]]:
        """``(job, attempt) -> ranks`` of running cloud gangs whose instances were created more than
        ``cloud.start_deadline_s`` ago and that have a rank that never reported (one query)."""
        cutoff = now - timedelta(seconds=self.settings.cloud.start_deadline_s)
        out: dict[tuple[str, int], list[int]] = {}
        rows = s.execute(select(CloudInstance.job_id, CloudInstance.attempt, CloudInstance.rank)
                         .join(Job, (Job.id == CloudInstance.job_id) & (Job.attempt == CloudInstance.attempt))
                         .where(Job.state == S.running.value, Job.dispatched_at < cutoff, Job.stop_reason.is_(None),
                                CloudInstance.state == "running", CloudInstance.provider_instance_id.is_not(None),
                                CloudInstance.last_report_at.is_(None)))
        for job_id, attempt, rank in rows:
            out.setdefault((job_id, attempt), []).append(rank)
        return {k: sorted(v) for k, v in out.items()}

    def _requeue_silent(self, job_id: str, attempt: int, ranks: list[int], now: datetime) -> int:
        """Requeue a gang a rank of which never started (the others would wait at the rendezvous forever)."""
        c = self.settings.cloud
        why = (f"rank(s) {ranks} never reported running within {c.start_deadline_s:.0f} s "
               f"(they report to {self.settings.effective_report_url})")
        n = 0
        with self.store.session() as s:
            j = s.get(Job, job_id)
            if j is not None and j.attempt == attempt and j.state == S.running.value:
                self.mark_attempt(s, job_id, attempt, f"StartTimeout: {why}", now)
                n = requeue_lost(s, j, now, why, "timed_out", max_attempts=self.settings.max_attempts)
        self.teardown(job_id, attempt, "a rank of the gang never started")
        return n

    def _listing(self, provider: str) -> dict[str, InstanceInfo] | None:
        """This broker's live instances on ``provider`` by id (one list call), ``None`` if it failed."""
        compute = self.computes.get(provider)
        if compute is None:
            return None
        try:
            return {i.instance_id: i for i in compute.list_managed(self.settings.cloud.broker_id)}
        except ProviderError as exc:
            log.warning("listing %s instances failed (%s); describing one by one this pass", provider, exc)
            return None

    def _gone_instance(self, placement: dict, listing: dict[str, InstanceInfo] | None = None,
                       now: datetime | None = None, created: datetime | None = None) -> tuple[str, bool, str] | None:
        """The first instance of a placement that is no longer up: ``(instance id, spot reclaimed?, state)``.

        ``listing`` (this broker's live instances, by id) answers for every instance in it; only one missing
        from it is described. An instance not found within ``NOT_FOUND_GRACE_S`` of its creation is not taken
        as gone (EC2's describe calls are eventually consistent right after a launch). Spot reclaimed: the
        provider says so where it can (GCE: a ``compute.instances.preempted`` operation,
        ``GcpCompute.preempted``); otherwise a spot instance that is gone is taken as reclaimed."""
        compute = self.computes.get(placement.get("provider", ""))
        if compute is None:
            return None
        for part in placement.get("nodes", []):
            seen = listing.get(part["instance_id"]) if listing is not None else None
            if seen is not None:
                state = seen.state
            else:
                try:
                    state = compute.describe(part["instance_id"], part["zone"]).state
                except ProviderError as exc:
                    if exc.code != "NotFound":
                        log.warning("describe %s failed: %s", part["instance_id"], exc)
                        continue
                    young = now is not None and created is not None and (now - created).total_seconds() < NOT_FOUND_GRACE_S
                    if young and not self._preempted(compute, placement, part):
                        continue
                    state = "not found"
            if state not in ("stopping", "stopped", "terminated", "not found"):
                continue
            spot = placement.get("market") == "spot"
            if spot and callable(getattr(compute, "preempted", None)):
                spot = self._preempted(compute, placement, part)
            return part["instance_id"], spot, state
        return None

    @staticmethod
    def _preempted(compute: Compute, placement: dict, part: dict) -> bool:
        """Whether the provider says it preempted this spot instance (``False`` when it cannot tell)."""
        asked = getattr(compute, "preempted", None)
        if placement.get("market") != "spot" or not callable(asked):
            return False
        try:
            return bool(asked(part["instance_id"], part["zone"]))
        except ProviderError:
            return False

    def _terminate_dead_rows(self) -> int:
        """Terminate instances whose rows are live but whose attempt is not (a lost teardown request)."""
        with self.store.session() as s:
            live = self.live_attempts(s)
            dead = {(r.job_id, r.attempt) for r in s.execute(select(CloudInstance).where(
                CloudInstance.state.in_(LIVE_ROW_STATES))).scalars() if (r.job_id, r.attempt) not in live}
        return sum(self.teardown(jid, att, "the attempt is no longer live") for jid, att in sorted(dead))

    def sweep(self) -> list[InstanceInfo]:
        """Terminate instances tagged with our broker id whose ``(job, attempt)`` is not live; returns them.

        The live set is read BEFORE listing instances: an attempt that starts provisioning after the read has
        no instance in the listing unless its create ran after the read too, and then its job is live. Only an
        instance whose attempt ended before the read can be swept."""
        with self.store.session() as s:
            live = self.live_attempts(s)
        gone: list[InstanceInfo] = []
        for name, compute in self.computes.items():
            sweep = getattr(compute, "sweep", None)
            if not callable(sweep):
                continue
            try:
                got = sweep(self.settings.cloud.broker_id, live)
            except ProviderError as exc:
                log.warning("orphan sweep on %s failed: %s", name, exc)
                continue
            for inst in got:
                log.warning("orphan instance %s/%s (job %s attempt %s) terminated by the sweep", name,
                            inst.instance_id, inst.tags.get("fedbroker-job"), inst.tags.get("fedbroker-attempt"))
            gone.extend(got)
        if gone:
            with self.store.session() as s:
                ids = {i.instance_id for i in gone}
                for row in s.execute(select(CloudInstance).where(CloudInstance.provider_instance_id.in_(list(ids)))
                                     ).scalars():
                    row.state, row.error, row.updated_at = "terminated", "terminated by the orphan sweep", utcnow()
        return gone
