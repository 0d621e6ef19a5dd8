"""Prometheus metrics of the broker, read from the store at each scrape (``GET /metrics``).

The numbers live in the database, not in process counters, so every API process answers the same and a
restart loses nothing. :func:`render_metrics` builds a registry with one :class:`StoreCollector` and
returns the text exposition format. The metric names (all ``fedbroker_``-prefixed) are :data:`METRIC_NAMES`;
``deploy/grafana/fedbroker.json`` reads only these (a test checks it). Cost, kWh and kgCO2e come from the
usage ledger (:mod:`broker.service.store.usage`), budget use from :mod:`broker.service.budgets`, live signal
health from ``signal_fetches`` (:func:`signal_families`; the same for every scope: it is no team's data).
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from broker.service.budgets import budget_states
from broker.service.store import metrics as rows
from broker.service.store.core import JobStore

__all__ = ["StoreCollector", "ScrapeCache", "render_metrics", "METRIC_NAMES", "WAIT_BUCKETS_S", "CONTENT_TYPE",
           "SCRAPE_CACHE_S", "signal_families"]

#: the exposition format's content type
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: seconds a scope's exposition is reused (Prometheus' default scrape interval is 15 s)
SCRAPE_CACHE_S = 10.0
#: upper bounds of the wait histogram's buckets, seconds (1 min ... 1 day; the deadlines' scale)
WAIT_BUCKETS_S = (60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0)
#: every metric this module exposes
METRIC_NAMES = ("fedbroker_jobs", "fedbroker_queue_depth", "fedbroker_cloud_instances",
                "fedbroker_attempt_gpu_hours", "fedbroker_job_wait_seconds", "fedbroker_usage_cost_usd",
                "fedbroker_usage_energy_kwh", "fedbroker_usage_carbon_kg", "fedbroker_budget_cap_usd",
                "fedbroker_budget_spent_usd", "fedbroker_budget_committed_usd", "fedbroker_signal_age_seconds",
                "fedbroker_signal_fallback", "fedbroker_signal_fetch_errors")


class StoreCollector(Collector):
    """Collects :data:`METRIC_NAMES` from ``store`` at ``now`` (UTC), for one ``team`` or for all (None)."""

    def __init__(self, store: JobStore, team: str | None, now: datetime):
        self.store, self.team, self.now = store, team, now

    def collect(self) -> Iterator[Metric]:
        """One read transaction; the families in :data:`METRIC_NAMES` order."""
        with self.store.session() as s:
            states = rows.job_state_counts(s, self.team)
            queued = rows.queue_depth(s, self.team)
            instances = rows.cloud_instance_counts(s, self.team)
            held = rows.attempt_gpu_seconds(s, self.team, self.now)
            waits = rows.wait_histogram(s, self.team, WAIT_BUCKETS_S)
            usage = rows.usage_sums(s, self.team)
            budgets = budget_states(s, self.now, self.team)
        jobs = GaugeMetricFamily("fedbroker_jobs", "Jobs on record by team and state.", labels=["team", "state"])
        for t, st, n in states:
            jobs.add_metric([t, st], n)
        yield jobs
        depth = GaugeMetricFamily("fedbroker_queue_depth", "Queued jobs by team and committed pool ('' = not yet "
                                  "committed to a pool).", labels=["team", "pool"])
        for t, p, n in queued:
            depth.add_metric([t, p], n)
        yield depth
        inst = GaugeMetricFamily("fedbroker_cloud_instances", "Cloud instance records by provider and state.",
                                 labels=["provider", "state"])
        for pr, st, n in instances:
            inst.add_metric([pr, st], n)
        yield inst
        gh = GaugeMetricFamily("fedbroker_attempt_gpu_hours", "GPU-hours held by attempts on record (running ones "
                               "up to now), by team, kind (onprem/cloud) and place (pool or provider).",
                               labels=["team", "kind", "place"])
        for t, k, p, sec in held:
            gh.add_metric([t, k, p], sec / 3600.0)
        yield gh
        hist = HistogramMetricFamily("fedbroker_job_wait_seconds", "Seconds from submission to the start of "
                                     "the current run, jobs on record that started, by team.", labels=["team"])
        for t, under, n, total in waits:
            buckets = [(_le(b), float(c)) for b, c in zip(WAIT_BUCKETS_S, under)]
            buckets.append(("+Inf", float(n)))
            hist.add_metric([t], buckets, sum_value=total)
        yield hist
        fams = [CounterMetricFamily(name, doc, labels=["team", "provider", "line"]) for name, doc in (
            ("fedbroker_usage_cost_usd", "Billed USD of the usage ledger's lines (line: instance, disk, energy, "
                                          "amortised; idle and idle_amortised: unallocated)."),
            ("fedbroker_usage_energy_kwh", "Facility kWh of the usage ledger's lines."),
            ("fedbroker_usage_carbon_kg", "kgCO2e (location-based) of the usage ledger's lines."))]
        for t, pr, ln, usd, kwh, kg in usage:
            for fam, v in zip(fams, (usd, kwh, kg)):
                if v is not None:  # no record of the group knows it: no sample rather than a false 0
                    fam.add_metric([t, pr, ln], v)
        yield from fams
        bud = [GaugeMetricFamily(name, doc, labels=["team"]) for name, doc in (
            ("fedbroker_budget_cap_usd", "The team's monthly cloud budget cap, USD."),
            ("fedbroker_budget_spent_usd", "Billed USD of the team's cloud lines this month (UTC)."),
            ("fedbroker_budget_committed_usd", "Estimated USD of the team's cloud attempts not metered yet."))]
        for b in budgets:
            for fam, v in zip(bud, (b.cap_usd, b.spent_usd, b.committed_usd)):
                fam.add_metric([b.team], v)
        yield from bud
        yield from signal_families(self.store, self.now.timestamp())


def signal_families(store: JobStore, now_s: float) -> list[Metric]:
    """The live-signal families at ``now_s`` (POSIX s) from ``signal_fetches`` (one row per configured source,
    zone and kind, so the label sets are bounded by the ``signals:`` settings):

    * ``fedbroker_signal_age_seconds{zone,kind,source}`` — seconds since the source last delivered the zone's
      values (no sample until it has once);
    * ``fedbroker_signal_fallback{zone,kind}`` — 1 while no source of the zone has a value younger than its
      ``stale_after_s`` (the planner decides on last-known values and the bundled replay), else 0;
    * ``fedbroker_signal_fetch_errors_total{source,error}`` — failed fetches by class
      (:data:`broker.service.signal_cache.ERROR_CLASSES`).
    """
    from broker.service.signal_cache import is_fresh
    from broker.service.store import signals as signal_rows

    with store.session() as s:
        fetches = [(f.zone, f.kind, f.source, f.last_success_at, f.stale_after_s, dict(f.error_counts or {}))
                   for f in signal_rows.fetch_rows(s)]
    age = GaugeMetricFamily("fedbroker_signal_age_seconds", "Seconds since a live signal source last delivered "
                            "a zone's values, by zone, kind (carbon/price) and source.", labels=["zone", "kind", "source"])
    fallback = GaugeMetricFamily("fedbroker_signal_fallback", "1 while no live source of the zone is fresh (the "
                                 "planner decides on last-known values and the bundled history), by zone and kind.",
                                 labels=["zone", "kind"])
    errors = CounterMetricFamily("fedbroker_signal_fetch_errors", "Failed fetches of live signal sources, by source "
                                 "and error class.", labels=["source", "error"])
    fresh: dict[tuple[str, str], bool] = {}
    per_error: dict[tuple[str, str], int] = {}
    for zone, kind, source, ok_at, stale_s, counts in fetches:
        ok = ok_at is not None and is_fresh(ok_at.timestamp(), now_s, stale_s)
        fresh[(zone, kind)] = fresh.get((zone, kind), False) or ok
        if ok_at is not None:
            age.add_metric([zone, kind, source], max(0.0, now_s - ok_at.timestamp()))
        for cls, n in counts.items():
            per_error[(source, cls)] = per_error.get((source, cls), 0) + int(n)
    for (zone, kind), ok in sorted(fresh.items()):
        fallback.add_metric([zone, kind], 0.0 if ok else 1.0)
    for (source, cls), n in sorted(per_error.items()):
        errors.add_metric([source, cls], float(n))
    return [age, fallback, errors]


def _le(bound_s: float) -> str:
    return floatToGoString(bound_s)  # "60.0", as prometheus_client writes its own histograms' bounds


def render_metrics(store: JobStore, team: str | None, now: datetime) -> bytes:
    """The text exposition of :class:`StoreCollector` for ``team`` (None: every team), UTF-8 bytes."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, team, now))
    return generate_latest(registry)


class ScrapeCache:
    """The last exposition per scope (a team, or None for admin), reused for ``ttl_s`` seconds, so a token
    that scrapes in a loop costs the database one read per scope and period (:data:`SCRAPE_CACHE_S`)."""

    def __init__(self, store: JobStore, ttl_s: float = 0.0):
        self.store, self.ttl_s = store, ttl_s
        self._last: dict[str | None, tuple[float, bytes]] = {}

    def get(self, team: str | None, now: datetime) -> bytes:
        """The exposition for ``team`` at ``now`` (UTC), at most ``ttl_s`` seconds old."""
        t = now.timestamp()
        hit = self._last.get(team)
        if hit is not None and t - hit[0] < self.ttl_s:
            return hit[1]
        body = render_metrics(self.store, team, now)
        if len(self._last) > 10_000:  # teams are bounded by the token table; never grow without end
            self._last.clear()
        self._last[team] = (t, body)
        return body
