"""Watching cloud attempts (a reconciler step), tearing their instances down, and sweeping orphans.

:meth:`Watching.watch`, every reconciler pass:

* cancel requested -> instances terminated, job cancelled;
* a gang being stopped whose ``stop_window`` passed -> the attempt ends with the ranks that reported;
* a running gang with a rank that never reported within ``cloud.start_deadline_s`` -> requeued;
* an instance of an active attempt gone (spot reclaimed, lost) -> every instance of the attempt terminated,
  job requeued from its checkpoint (all or nothing);
* instance rows of attempts that are no longer live -> terminated;
* every ``cloud.sweep_interval_s``: instances tagged with our broker id but no live attempt -> terminated
  (:meth:`Watching.sweep`).

The ends of attempts are decided by :mod:`broker.service.lifecycle`; instance rows change state through
:mod:`broker.service.store.cloud` (checked against :mod:`broker.instance_states`, with history).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from broker.instance_states import InstanceState
from broker.service import lifecycle
from broker.service.lifecycle import Place
from broker.service.store import attempts as jobs
from broker.service.store import cloud as instances
from broker.service.store.tables import utcnow
from broker.states import ACTIVE_STATE_VALUES, JobState
from providers.base import Compute, InstanceInfo, ProviderError

__all__ = ["NOT_FOUND_GRACE_S", "Watching"]

log = logging.getLogger("fedbroker.cloud")
S = JobState
#: seconds after its creation during which an instance the provider does not find is not taken as gone
NOT_FOUND_GRACE_S = 120.0


class Watching:
    """The watch, teardown and sweep part of :class:`broker.service.cloud.CloudBroker`; needs ``self.store``,
    ``self.settings``, ``self.computes``, ``self._teardown_cb``, ``self._last_poll`` (job -> monotonic
    seconds), ``self._last_sweep``, and the other parts' :meth:`cooldown_s`, :meth:`mark_attempt` and
    :attr:`stop_window`."""

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
        again once the attempt has ended); a row with no instance id becomes ``abandoned`` (if the create went
        through, the sweep finds the instance by its tags)."""
        with self.store.session() as s:
            rows = [r for r in instances.live_rows(s, job_id, attempt) if ranks is None or r[1] in ranks]
        n = 0
        for row_id, _rank, provider, instance_id, zone in rows:
            state, err = InstanceState.terminated, why
            if instance_id is not None:
                compute = self.computes.get(provider)
                try:
                    if compute is None:
                        raise ProviderError(f"no adapter for provider {provider!r}")
                    compute.terminate(instance_id, zone)
                    n += 1
                except ProviderError as exc:
                    state, err = InstanceState.terminating, f"{why}; terminate failed: {exc}"
                    log.warning("terminate %s/%s failed: %s", provider, instance_id, exc)
            else:
                state = InstanceState.abandoned
            with self.store.session() as s:
                # a row whose error says why its offer cools down (and since when) keeps it
                now = utcnow()
                instances.end_teardown(s, row_id, state, err, now, lambda e: self.cooldown_s(e) > 0)
                if state is not InstanceState.terminating:  # deleted: its disk and idle time, in this transaction
                    lifecycle.record_instance_usage(s, job_id, attempt, now)
        return n

    # ------------------------------------------------------------------ watching (reconciler)
    def live_attempts(self, s) -> set[tuple[str, int]]:
        """``(job, attempt)`` of every job whose current attempt may hold instances (inside session ``s``)."""
        return instances.live_attempts(s, ACTIVE_STATE_VALUES)

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
            active = [(j.id, j.attempt, j.state, j.cancel_requested, dict(j.placement or {}), j.dispatched_at,
                       j.state == S.running.value and j.stop_reason is not None)
                      for j in instances.active_cloud_jobs(s, [S.starting.value, S.running.value])]
            silent = instances.silent_ranks(s, now - timedelta(seconds=c.start_deadline_s), S.running.value)
        due: list[tuple[str, int, dict, datetime | None]] = []
        for job_id, attempt, state, cancel, pl, dispatched, stopping in active:
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
                j = jobs.job_row(s, job_id)
                if j is not None and j.attempt == attempt and j.state in (S.starting.value, S.running.value):
                    spot = j.stop_reason == "spot" or gone[1]
                    why = (f"instance {gone[0]} was reclaimed (spot interruption)" if spot
                           else f"instance {gone[0]} is gone ({gone[2]})") + "; all ranks stopped"
                    if spot:
                        self.mark_attempt(s, job_id, attempt, f"Reclaimed: {why}", now)
                    if gone[2] in ("stopping", "stopped"):  # its disk bills until deleted, its compute no more
                        lifecycle.note_instance_stopped(jobs.attempt_row(s, job_id, attempt), gone[0], now)
                    out["lost"] += lifecycle.requeue_lost(s, j, now, why, "interrupted",
                                                          max_attempts=None if spot else self.settings.max_attempts)
            self.teardown(job_id, attempt, "another instance of the gang is gone")
        live = {j[0] for j in active}
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
            j = jobs.job_row(s, job_id)
            if j is not None and j.attempt == attempt and j.state == state:
                n = lifecycle.cancel_attempt(s, j, now, Place.instance(""))
        self.teardown(job_id, attempt, "the job was cancelled")
        return n

    def _end_stopping(self, job_id: str, attempt: int, now: datetime) -> int:
        """A gang being stopped (a rank ended, or a spot notice) is not polled: its ranks report as they stop.
        Once ``stop_window`` has passed without every report, the attempt ends with what it has: requeued after
        a spot notice (from its checkpoint), failed after a failed rank. Returns 1 if it ended here."""
        n = 0
        with self.store.session() as s:
            j = jobs.job_row(s, job_id)
            if (j is None or j.attempt != attempt or j.state != S.running.value or j.state_deadline_at is None
                    or j.state_deadline_at > now):
                return 0
            att = jobs.attempt_row(s, job_id, attempt, lock=True)
            if att is None:
                return 0
            exits = dict(att.rank_exits or {})
            nranks = len((j.placement or {}).get("nodes", [])) or 1
            for r in range(nranks):
                exits.setdefault(str(r), "lost")
            att.rank_exits = exits
            where = Place.instance(f"ranks that did not report within {self.stop_window.total_seconds():.0f} s")
            ok, _ = lifecycle.end_attempt(s, j, att, now, None if j.stop_reason == "spot" else att.exit_code, exits,
                                          where, max_attempts=self.settings.max_attempts)
            n = int(ok)
        self.teardown(job_id, attempt, "the gang's stop window passed")
        return n

    def _requeue_silent(self, job_id: str, attempt: int, ranks: list[int], now: datetime) -> int:
        """Requeue a gang a rank of which never started (the others would wait at the rendezvous forever)."""
        c = self.settings.cloud
        why = (f"rank(s) {ranks} never reported running within {c.start_deadline_s:.0f} s "
               f"(they report to {self.settings.effective_report_url})")
        n = 0
        with self.store.session() as s:
            j = jobs.job_row(s, job_id)
            if j is not None and j.attempt == attempt and j.state == S.running.value:
                self.mark_attempt(s, job_id, attempt, f"StartTimeout: {why}", now)
                n = lifecycle.requeue_lost(s, j, now, why, "timed_out", max_attempts=self.settings.max_attempts)
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
            dead = {k for k in instances.attempts_with_live_rows(s) if k not in live}
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
                now = utcnow()
                for job_id, attempt in instances.mark_swept(s, {i.instance_id for i in gone}, now):
                    lifecycle.record_instance_usage(s, job_id, attempt, now)
        return gone

