"""Provider-neutral failover: create one rank's instance on the first option of a ranked list that works.

:func:`provision_with_failover` walks the planner's ranked options (the list order *is* the failover
order: zone -> instance type -> region -> provider) and applies the rules of ARCHITECTURE.md §5:

1. **Intent first.** ``record_intent(req)`` is called before the first create call of each option
   (the ``cloud_instances`` row in state ``intent``). A retry of the same option (throttling) reuses
   the same request and token, so it reuses that intent row; ``record_intent`` must be idempotent on
   ``req.token`` (the column is unique). The token comes from
   :func:`providers.base.idempotency_token` (job, attempt, offer, rank), and the instance carries
   :func:`providers.base.instance_tags`, so a broker that dies between the create call and recording
   the instance id leaves an instance the sweep finds.
2. **Preflight.** If the adapter has a quota preflight (:class:`SupportsQuotaPreflight`) it runs
   before the intent; a :class:`QuotaExceeded` from it is handled like one from the create call.
   Any other failure of the preflight is ignored (it is advisory; the create call still classifies).
3. **NoCapacity / Unsupported** -> recorded in ``history``; go on with the next option.
4. **QuotaExceeded** -> recorded; the option's *quota scope* is blocked: later options in the same
   scope are skipped without a call (listed in ``ProvisioningFailed.skipped``, not in the history,
   which holds only options tried). The scope is ``(provider, region, market, family)``: EC2 vCPU and
   GCP GPU quotas are regional, per market, per instance family / GPU type. ``family`` is
   ``compute.quota_family(instance_type)`` when the adapter has it, else the option's ``gpu_type``.
5. **Throttled** -> sleep and retry the same option, at most ``max_throttle_retries`` times; the
   delay is the error's ``retry_after_s`` when given, else ``throttle_base_s * 2**n`` (1, 2, 4 s ...)
   capped at ``throttle_max_s``. Each throttled try is recorded; when the retries are spent the
   option counts as failed and the next option is tried.
6. **Any other ProviderError** (unknown) -> recorded, next option; after ``max_unknown_errors`` (3)
   of them in total the walk stops. An instance that comes back already ``terminated`` counts as one
   (``code="TerminatedAtLaunch"``). Exceptions that are not ``ProviderError`` (bugs) propagate.
7. **Success** -> recorded with no error; returns ``(option, instance)``.
8. **All failed** -> :class:`ProvisioningFailed` with the full history.

An option whose provider has no adapter in ``computes`` is recorded as :class:`Unsupported`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from providers.base import (
    Compute,
    FailoverHistory,
    InstanceInfo,
    InstanceRequest,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    Throttled,
    Unsupported,
    idempotency_token,
    instance_tags,
)

__all__ = ["OfferOption", "ProvisioningFailed", "provision_with_failover", "provision_gang", "quota_scope"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfferOption:
    """One place to create an instance: what the provisioner needs of a ``broker.model.CloudOffer``.

    ``market`` is ``"spot"`` or ``"on_demand"``. ``offer_id`` is ``provider:zone:instance_type:market``,
    the same as ``CloudOffer.offer_id``.
    """

    provider: str
    region: str
    zone: str
    instance_type: str
    market: str
    gpu_type: str = ""
    gpu_count: int = 1

    @property
    def offer_id(self) -> str:
        """``provider:zone:instance_type:market``, as ``CloudOffer.offer_id``."""
        return f"{self.provider}:{self.zone}:{self.instance_type}:{self.market}"

    @classmethod
    def of(cls, offer: Any) -> OfferOption:
        """An ``OfferOption`` from a ``CloudOffer`` (or anything with the same attributes)."""
        if isinstance(offer, OfferOption):
            return offer
        market = getattr(offer.market, "value", offer.market)
        return cls(offer.provider, offer.region, offer.zone, offer.instance_type, str(market),
                   getattr(offer, "gpu_type", ""), int(getattr(offer, "gpu_count", 1)))


class ProvisioningFailed(ProviderError):
    """Every option failed (or too many unknown errors). ``history`` has each try; ``skipped`` the
    offer ids not tried because an earlier quota error blocked their scope."""

    def __init__(self, message: str, history: FailoverHistory, skipped: list[str] | None = None,
                 code: str = "AllOptionsFailed"):
        super().__init__(message, None, code)
        self.history = history
        self.skipped = list(skipped or [])


def quota_scope(option: OfferOption, compute: Compute | None) -> tuple[str, str, str, str]:
    """``(provider, region, market, family)`` a quota error on ``option`` blocks (see the module doc)."""
    fam_of = getattr(compute, "quota_family", None)
    family = fam_of(option.instance_type) if callable(fam_of) else option.gpu_type
    return (option.provider, option.region, option.market, str(family))


def provision_with_failover(
    job_id: str,
    attempt: int,
    rank: int,
    team: str,
    options: list[Any],
    computes: dict[str, Compute],
    user_data_for: Callable[[Any], str],
    broker_id: str,
    history: FailoverHistory,
    record_intent: Callable[[InstanceRequest], None],
    sleep: Callable[[float], None] = time.sleep,
    max_throttle_retries: int = 3,
    max_unknown_errors: int = 3,
    throttle_base_s: float = 1.0,
    throttle_max_s: float = 60.0,
    gang_size: int = 1,
) -> tuple[Any, InstanceInfo]:
    """Create rank ``rank`` of attempt ``attempt`` of ``job_id`` on the first of ``options`` that works.

    ``options`` are ``OfferOption`` or ``CloudOffer`` in failover order; the returned option is the
    caller's own object. ``user_data_for(option)`` gives the cloud-init script for that option (it
    is called with the caller's object). ``history`` is appended to (store it with the job).
    Rules: see the module docstring. Raises :class:`ProvisioningFailed`.
    """
    blocked: set[tuple[str, str, str, str]] = set()
    skipped: list[str] = []
    unknown = 0
    for original in options:
        opt = OfferOption.of(original)
        compute = computes.get(opt.provider)
        if compute is None:
            history.record(opt.offer_id, Unsupported(f"no adapter for provider {opt.provider!r}", opt.offer_id,
                                                     "NoAdapter"), rank=rank)
            continue
        scope = quota_scope(opt, compute)
        if scope in blocked:
            skipped.append(opt.offer_id)
            continue
        req = InstanceRequest(
            job_id=job_id, attempt=attempt, rank=rank, team=team, offer_id=opt.offer_id, region=opt.region,
            zone=opt.zone, instance_type=opt.instance_type, market=opt.market, gpu_type=opt.gpu_type,
            gpu_count=opt.gpu_count, user_data=user_data_for(original),
            tags=instance_tags(job_id, attempt, rank, team, broker_id),
            token=idempotency_token(job_id, attempt, opt.offer_id, rank), gang_size=gang_size)
        try:
            info = _try_option(compute, req, history, record_intent, sleep, max_throttle_retries,
                               throttle_base_s, throttle_max_s)
        except QuotaExceeded as exc:
            history.record(opt.offer_id, exc, rank=rank)
            blocked.add(scope)
            continue
        except (NoCapacity, Unsupported, Throttled) as exc:
            history.record(opt.offer_id, exc, rank=rank)
            continue
        except ProviderError as exc:
            history.record(opt.offer_id, exc, rank=rank)
            unknown += 1
            if unknown >= max_unknown_errors:
                raise ProvisioningFailed(
                    f"{job_id} attempt {attempt} rank {rank}: {unknown} unknown provider errors, giving up "
                    f"(last: {exc})", history, skipped, code="TooManyErrors") from exc
            continue
        history.record(opt.offer_id, rank=rank)
        return original, info
    raise ProvisioningFailed(
        f"{job_id} attempt {attempt} rank {rank}: all {len(options)} options failed "
        f"({len(history.attempts)} tries, {len(skipped)} skipped for quota)", history, skipped)


def _try_option(compute: Compute, req: InstanceRequest, history: FailoverHistory,
                record_intent: Callable[[InstanceRequest], None], sleep: Callable[[float], None],
                max_throttle_retries: int, base_s: float, max_s: float) -> InstanceInfo:
    """Preflight, intent, then the create call with throttling retries; raises the final error."""
    preflight = getattr(compute, "preflight", None)
    if callable(preflight):
        try:
            preflight(req)
        except QuotaExceeded:
            raise
        except (ProviderError, NotImplementedError) as exc:
            log.info("preflight of %s skipped: %s", req.offer_id, exc)
    record_intent(req)
    tries = 0
    while True:
        try:
            info = compute.launch(req)
        except Throttled as exc:
            if tries >= max_throttle_retries:
                raise
            history.record(req.offer_id, exc, rank=req.rank)
            delay = exc.retry_after_s if exc.retry_after_s is not None else min(max_s, base_s * 2 ** tries)
            tries += 1
            sleep(delay)
            continue
        if info.state == "terminated":
            raise ProviderError(f"instance {info.instance_id} was already terminated at launch",
                                req.offer_id, "TerminatedAtLaunch")
        return info


def provision_gang(
    job_id: str,
    attempt: int,
    team: str,
    nodes: int,
    options: list[Any],
    computes: dict[str, Compute],
    user_data_for: Callable[[Any, int, str | None], str],
    broker_id: str,
    history: FailoverHistory,
    record_intent: Callable[[InstanceRequest], None],
    on_failed_gang: Callable[[Any, list[tuple[int, InstanceInfo]]], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_parallel: int = 8,
    **kw: Any,
) -> tuple[Any, list[InstanceInfo]]:
    """Create all ``nodes`` instances of a gang on ONE option (all or nothing), failing over as a whole.

    Rank 0 goes through :func:`provision_with_failover` over ``options``; ranks 1.. are then created on
    the option rank 0 got (same zone, type and market: NCCL needs the gang together), up to
    ``max_parallel`` at once (``record_intent`` and the adapter must be thread-safe: each call opens its own
    database session; boto3 clients and google-cloud-compute clients are), with
    ``user_data_for(option, rank, rank0_private_ip)`` (rank 0 gets ``None``: its script finds its own
    address at boot). If a later rank fails, the instances made so far are terminated (and passed to
    ``on_failed_gang(option, [(rank, instance), ...])`` first), and the walk goes on with the options after that one.
    ``kw`` goes to :func:`provision_with_failover` (throttling limits). Returns ``(option, [instance per
    rank])``. Raises :class:`ProvisioningFailed` with the whole history when no option holds the gang.
    """
    remaining = list(options)
    skipped: list[str] = []
    while remaining:
        opt, first = provision_with_failover(job_id, attempt, 0, team, remaining, computes,
                                             lambda o: user_data_for(o, 0, None), broker_id, history,
                                             record_intent, sleep=sleep, gang_size=nodes, **kw)
        made = [first]
        if nodes > 1 and not first.private_ip:
            raise ProvisioningFailed(f"{job_id} attempt {attempt}: rank 0 instance {first.instance_id} has no "
                                     "private address for the rendezvous", history, skipped, code="NoPrivateAddress")

        def create(rank: int) -> InstanceInfo:
            return provision_with_failover(job_id, attempt, rank, team, [opt], computes,
                                           lambda o: user_data_for(o, rank, first.private_ip), broker_id,
                                           history, record_intent, sleep=sleep, gang_size=nodes, **kw)[1]

        failed: list[ProvisioningFailed] = []
        ranks = [0]
        if nodes > 1:
            # the other ranks at once (a GCE insert may wait for its operation): at most max_parallel calls in flight
            with ThreadPoolExecutor(max_workers=min(max_parallel, nodes - 1), thread_name_prefix="provision") as pool:
                futures = [(rank, pool.submit(create, rank)) for rank in range(1, nodes)]
                for rank, fut in futures:
                    try:
                        made.append(fut.result())
                        ranks.append(rank)
                    except ProvisioningFailed as exc:
                        failed.append(exc)
        if failed:
            for exc in failed:
                skipped.extend(exc.skipped)
            compute = computes[OfferOption.of(opt).provider]
            if on_failed_gang is not None:
                on_failed_gang(opt, list(zip(ranks, made)))
            for inst in made:
                try:
                    compute.terminate(inst.instance_id, inst.zone)
                except ProviderError as err:  # the sweep terminates it later (tagged, attempt not live)
                    log.warning("could not terminate %s of a partial gang: %s", inst.instance_id, err)
            remaining = remaining[[OfferOption.of(o).offer_id for o in remaining].index(OfferOption.of(opt).offer_id) + 1:]
            continue
        return opt, made  # rank order: rank 0, then the futures in rank order
    raise ProvisioningFailed(f"{job_id} attempt {attempt}: no option could hold all {nodes} node(s) "
                             f"({len(history.attempts)} tries)", history, skipped)
