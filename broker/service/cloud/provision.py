"""Provisioning: create a placed job's instances, failing over between options, with intent rows first.

``provisioning`` job -> :meth:`Provisioning.provision`:

* failover options (:func:`failover_options`): the planner's offer, then zone -> instance type -> region ->
  provider (ARCHITECTURE.md §5), less offers cooling down (:mod:`.cooldown`);
* per rank: an intent row (``cloud_instances``, state ``intent``) BEFORE the create call, a tagged instance,
  an idempotency token from (job, attempt, offer, rank); rank 0 first, the others get its private address as
  ``MASTER_ADDR``; all or nothing (:func:`providers.provisioner.provision_gang`);
* -> ``starting`` (``placement.nodes = [{rank, instance_id, zone, private_ip, node}]``), or -> ``queued``
  (every option failed; the failover history is on the attempt, the failed offers cool down, and the
  attempt does not count against ``max_attempts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.planner.core import shape_groups, smallest_shape_mask
from broker.service.cloud.adapters import offer_allowed
from broker.service import lifecycle
from broker.service.store import attempts as jobs
from broker.service.store import cloud as instances
from broker.service.store.core import JobStore
from broker.service.store.tables import utcnow
from broker.states import JobState
from providers.base import FailoverHistory, InstanceInfo, InstanceRequest, idempotency_token

__all__ = ["failover_options", "Provisioning"]

S = JobState


def failover_options(offers: Iterable, chosen_id: str, spec: dict, allowed: Callable[[object], bool],
                     cooling: set[str] = frozenset(), limit: int = 8, canon: Callable[[str], str] = str) -> list:
    """The options one cloud attempt tries, in order: the planner's choice, then zone -> instance type ->
    region -> provider (ARCHITECTURE.md §5), each group cheapest first per GPU-hour.

    ``offers``: every ``CloudOffer``; ``spec``: the job spec (dict). An option must hold the job the way
    the planner's ``compatible_offers`` does (GPU type in ``gpu_types``, one instance per node of the smallest
    shape holding ``gpus_per_node`` in its zone: :func:`broker.planner.core.smallest_shape_mask`; memory, spot only
    if ``spot_allowed``, ``allowed_regions``, ``max_price_usd_per_hour`` (USD/hour) for all nodes), be ``allowed``
    and not ``cooling`` (the chosen offer is always first when allowed). At most ``limit`` options."""
    offers = list(offers)
    by_id = {o.offer_id: o for o in offers}
    chosen = by_id.get(chosen_id)
    types = {canon(t) for t in spec.get("gpu_types") or ()}
    regions = set(spec.get("allowed_regions") or ())
    gpn, nodes = int(spec["gpus_per_node"]), int(spec["nodes"])
    cap = spec.get("max_price_usd_per_hour")
    mask = smallest_shape_mask(shape_groups(offers), [o.gpu_count for o in offers], gpn)
    shape_ok = {o.offer_id for o, ok in zip(offers, mask) if ok}

    def fits(o) -> bool:
        market = getattr(o.market, "value", o.market)
        if types and canon(o.gpu_type) not in types:
            return False
        if o.offer_id not in shape_ok:
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


class Provisioning:
    """The provisioning part of :class:`broker.service.cloud.CloudBroker`; needs ``self.store``,
    ``self.settings``, ``self.offers_at``, ``self.computes``, ``self.canon``, ``self.sleep``, and the other parts'
    :meth:`token`, :meth:`cooling_offers` and :meth:`teardown`."""

    def provision(self, job_id: str, attempt: int, now: datetime | None = None) -> str:
        """Create every instance of a ``provisioning`` job's attempt, or put the job back in the queue.

        Idempotent: a second call for the same attempt finds the instances by their tokens; a call for a
        job no longer ``provisioning`` with that attempt returns ``"stale"``. Returns a short outcome:
        ``"stale"``, ``"cancelled"``, ``"requeued"`` or ``"starting on OFFER (N instance(s))"``."""
        from broker.model import JobSpec
        from providers.launch import cloud_init, launch_spec
        from providers.provisioner import ProvisioningFailed, provision_gang

        now = now or utcnow()
        with self.store.session() as s:
            j = jobs.job_row(s, job_id)
            if j is None or j.state != S.provisioning.value or j.attempt != attempt:
                return "stale"
            if j.cancel_requested:
                JobStore.cas(s, j.id, j.version, S.provisioning.value, S.cancelled.value,
                             "cancelled by user before its instances were created", now, finished_at=now)
                return "cancelled"
            job = _Launch(j.id, attempt, j.team, dict(j.spec), (j.placement or {}).get("offer_id", ""))
            instances.add_cloud_attempt(s, j.id, attempt, job.offer_id, (j.placement or {}).get("gpu_type"),
                                        int(j.spec["gpus_per_node"]) * int(j.spec["nodes"]), now)
            cooling = self.cooling_offers(s, now)

        spec = JobSpec.model_validate(job.spec)
        options = failover_options(self.offers_at(now.timestamp()), job.offer_id, job.spec, lambda o: offer_allowed(self.settings, o),
                                   cooling, self.settings.cloud.max_failover_options, self.canon)
        history = FailoverHistory()
        c = self.settings.cloud
        launch_usd = {o.offer_id: o.usd_per_hour for o in options}  # each option's USD/h as priced now

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
                    instances.mark_gang_rank_dropped(
                        s, idempotency_token(job.job_id, attempt, option.offer_id, rank), inst.instance_id,
                        inst.private_ip, now, "another rank of the gang could not be created on this option")

        try:
            if not options:
                raise ProvisioningFailed(f"{job_id} attempt {attempt}: no allowed cloud option holds the job "
                                         f"(offer {job.offer_id!r} is not configured or cooling down)", history)
            option, made = provision_gang(
                job.job_id, attempt, job.team, spec.nodes, options, self.computes, user_data,
                c.broker_id, history, lambda req: self._record_intent(req, now, launch_usd.get(req.offer_id)),
                on_failed_gang=failed_gang,
                sleep=self.sleep)
        except ProvisioningFailed as exc:
            self._record_failures(job.job_id, attempt, history)
            with self.store.session() as s:
                self._save_history(s, job.job_id, attempt, history, ended=now, outcome="unprovisioned",
                                   reason=str(exc))
                j = jobs.job_row(s, job.job_id)
                if j is None or j.state != S.provisioning.value or j.attempt != attempt:
                    return "stale"
                tried = "; ".join(f"{a.option}: {a.error} ({a.message[:120]})" for a in history.attempts
                                  if a.error) or str(exc)
                # nothing ran: not counted against max_attempts; the failed offers cool down instead, so the
                # planner does not pick them again at once (a provider outage backs off, it does not fail jobs)
                lifecycle.requeue_lost(s, j, now, f"cloud provisioning failed: {tried}", outcome="unprovisioned",
                                       max_attempts=None)
            return "requeued"
        self._record_failures(job.job_id, attempt, history)
        parts = [{"rank": r, "instance_id": i.instance_id, "zone": i.zone, "private_ip": i.private_ip,
                  "node": f"{option.provider}/{i.instance_id}"} for r, i in enumerate(made)]
        ok = False
        with self.store.session() as s:
            for r, inst in enumerate(made):
                instances.mark_created(s, job.job_id, attempt, r, option.offer_id, inst.instance_id, inst.private_ip,
                                       now)
            self._save_history(s, job.job_id, attempt, history, offer_id=option.offer_id, nodes=parts)
            j = jobs.job_row(s, job.job_id)
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
        return f"starting on {option.offer_id} ({len(made)} instance(s))"

    def _record_intent(self, req: InstanceRequest, now: datetime, launch_usd_per_hour: float | None = None) -> None:
        """The intent record of one create call (idempotent on the request's token), with the USD/h the option was
        priced at now (:meth:`offers_at`: live cloud price or bundled catalog), the usage ledger's fallback."""
        with self.store.session() as s:
            instances.record_intent(s, req, now, launch_usd_per_hour)

    def _record_failures(self, job_id: str, attempt: int, history: FailoverHistory) -> None:
        """Intent rows of (option, rank) tries that failed get state ``failed`` and the error (the cooldown reads
        them); a try that was retried and then worked (throttling) is not a failure."""
        last: dict[tuple[str, int | None], object] = {}
        for a in history.attempts:
            last[(a.option, a.rank)] = a
        failed = {k: a for k, a in last.items() if a.error}
        if not failed:
            return
        with self.store.session() as s:
            instances.record_failures(s, job_id, attempt, failed, utcnow())

    def _save_history(self, s, job_id: str, attempt: int, history: FailoverHistory, ended: datetime | None = None,
                      outcome: str | None = None, reason: str | None = None, offer_id: str | None = None,
                      nodes: list | None = None) -> None:
        """Inside ``s``: append the failover ``history`` to the attempt's record; set its offer and ranks
        (``nodes``) when it got instances, or end it (``ended``, ``outcome``, ``reason``) when it got none."""
        att = jobs.attempt_row(s, job_id, attempt)
        if att is None:
            return
        att.failover = [*(att.failover or []), *history.to_json()]
        if offer_id is not None:
            att.offer_id = offer_id
        if nodes is not None:
            att.nodes = nodes
        if ended is not None:
            lifecycle.close_attempt(s, att, ended, outcome, reason or "")
