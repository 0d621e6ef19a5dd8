"""The allocation invariant (issue #12, item 2): over a simulated month of cloud and on-prem attempts run
through the one attempt lifecycle, every cost the provider bills is allocated exactly once — job lines +
unallocated = provider total, resource by resource — and a CUR-like CSV is read and reconciled.

The provider side is computed here, independently of the ledger: each instance billed from its create call
to its end at its list price, per second with a 60-second minimum (the AWS rule), written as a CUR-like CSV.
"""

from __future__ import annotations

import csv
import math
import random
from datetime import datetime, timedelta, timezone

import pytest

from broker.service import lifecycle
from broker.service.lifecycle import Place
from broker.service.reconcile import (CUR_COLUMNS, ReconcileError, read_cur_csv, reconcile_cloud,
                                      reconcile_energy)
from broker.service.store import attempts as repo
from broker.service.store import usage
from broker.service.store.tables import Job
from broker.usage import summarise
from pricing.errors import UnknownCurrencyError
from tests.broker.service.test_ledger import _prices  # noqa: F401 (autouse: the test prices, removed after)
from tests.broker.service.test_ledger import (AWS_OD, AWS_SPOT, _node, _teardown, _to_starting_cloud, cloud_job,
                                              hourly, iid, install, onprem_job, run_ranks)

UTC = timezone.utc
MONTH = datetime(2024, 3, 1, tzinfo=UTC)
NEXT = datetime(2024, 4, 1, tzinfo=UTC)


def provider_usd(price: float, seconds: float) -> float:
    """The bill of one instance, worked without the code under test: per second, 60-s minimum."""
    return price * max(60, math.ceil(seconds)) / 3600.0


def write_cur(path, lines):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["identity/LineItemId", *CUR_COLUMNS, "lineItem/CurrencyCode"])
        for k, (res, start, end, usd) in enumerate(lines):
            w.writerow([f"li-{k}", res, start.isoformat().replace("+00:00", "Z"),
                        end.isoformat().replace("+00:00", "Z"), f"{usd:.10f}", "USD"])


def test_a_simulated_month_allocates_every_billed_dollar_once(any_store, tmp_path):
    install(carbon={"AWS-ZONE": hourly("AWS-ZONE", "gCO2e/kWh", {}, 400.0, hours=24 * 32, start=MONTH)})
    rng = random.Random(12)
    bill = []  # (resource, start, end, USD), the provider's side
    jobs = []
    idle_only = tails = 0  # instances no job ran on; instances deleted after their job ended
    for k in range(24):
        offer = rng.choice([AWS_OD, AWS_SPOT])
        nodes = rng.choice([1, 1, 2])
        t0 = MONTH + timedelta(hours=rng.randrange(0, 29 * 24), seconds=rng.randrange(3600))
        run = rng.choice([15, 45, 59, 61, 600, 3599, 7300]) + rng.random()
        jid = cloud_job(any_store, offer, t0, nodes=nodes)
        jobs.append(jid)
        attempt, start = 1, t0
        if offer is AWS_OD and rng.random() < 0.3:  # never started: timed out after 600 s, deleted 20 s later
            with any_store.session() as s:
                assert lifecycle.requeue_lost(s, s.get(Job, jid), t0 + timedelta(seconds=600), "start deadline",
                                              "timed_out", max_attempts=5)
            _teardown(any_store, jid, 1, t0 + timedelta(seconds=620), ok=True)
            bill += [(iid(jid, 1, r), t0, t0 + timedelta(seconds=620), provider_usd(offer.usd_per_hour, 620))
                     for r in range(nodes)]
            idle_only += nodes
            attempt, start = 2, t0 + timedelta(hours=1)
            _to_starting_cloud(any_store, jid, offer, 2, start, nodes)
        elif offer is AWS_SPOT and rng.random() < 0.5:  # reclaimed after `cut` s, resumed 2 h later on attempt 2
            cut = rng.choice([30, 400, 1300])
            with any_store.session() as s:
                j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1)
                assert lifecycle.mark_running(s, j, att, t0 + timedelta(seconds=5), "running")
                s.refresh(j)
                assert repo.bump_with_event(s, j, t0 + timedelta(seconds=cut - 1), "notice", stop_reason="spot")
            outs = []
            for r in range(nodes):
                with any_store.session() as s:
                    j, att = s.get(Job, jid), repo.attempt_row(s, jid, 1, lock=True)
                    outs.append(lifecycle.rank_ended(s, j, att, r, 143, t0 + timedelta(seconds=cut),
                                                     Place.instance(f"rank {r}"), max_attempts=5).outcome)
            assert outs[-1] == "requeued"
            _teardown(any_store, jid, 1, t0 + timedelta(seconds=cut), ok=True)  # the provider deleted it
            bill += [(iid(jid, 1, r), t0, t0 + timedelta(seconds=cut), provider_usd(offer.usd_per_hour, cut))
                     for r in range(nodes)]
            attempt, start = 2, t0 + timedelta(hours=2)
            _to_starting_cloud(any_store, jid, offer, 2, start, nodes)
        end = start + timedelta(seconds=run)
        assert run_ranks(any_store, jid, attempt, start + timedelta(seconds=5),
                         [(r, 0, end) for r in range(nodes)])[-1] == "succeeded"
        # deleted at the end, or later: the terminate call failed and the retry came `late` s after
        late = rng.choice([0, 0, 0, 30, 7200])
        if late:
            _teardown(any_store, jid, attempt, end, ok=False)
        _teardown(any_store, jid, attempt, end + timedelta(seconds=late), ok=True)
        bill += [(iid(jid, attempt, r), start, end + timedelta(seconds=late),
                  provider_usd(offer.usd_per_hour, run + late)) for r in range(nodes)]
        tails += nodes if late else 0
    # two instances the provider billed that no job carried (an orphan the sweep terminated; a tagless one)
    orphans = [("i-orphan-1", MONTH + timedelta(days=3), MONTH + timedelta(days=3, minutes=9), provider_usd(3.06, 540)),
               ("", MONTH + timedelta(days=9), MONTH + timedelta(days=9, hours=1), 0.37)]
    bill += orphans
    # a ledger line of the month before is out of the period on both sides
    write_cur(tmp_path / "cur.csv", bill)
    lines = read_cur_csv(tmp_path / "cur.csv")
    assert len(lines) == len(bill)
    with any_store.session() as s:
        recs = usage.usage_rows(s)
    rec = reconcile_cloud(recs, lines, MONTH, NEXT, provider="aws")
    assert rec.ledger_only == () and rec.unpriced == 0
    assert rec.mismatched == ()  # every job instance: ledger job + idle USD == billed USD
    assert all(abs(r.difference_usd) < 1e-9 for r in rec.resources if r.resource.startswith("i-job"))
    # the invariant: job lines + unallocated = provider total; unallocated = the ledger's idle lines + exactly
    # the orphans (billed, in no ledger line)
    assert rec.allocated_usd + rec.unallocated_usd == pytest.approx(rec.provider_total_usd, abs=1e-9)
    assert rec.allocated_usd == pytest.approx(math.fsum(r.billed_usd for r in recs if r.line == "instance"), abs=1e-9)
    assert rec.idle_usd == pytest.approx(math.fsum(r.billed_usd for r in recs if r.line == "idle"), abs=1e-9)
    assert rec.unexplained_usd == pytest.approx(math.fsum(o[3] for o in orphans), abs=1e-9)
    assert rec.provider_total_usd == pytest.approx(math.fsum(b[3] for b in bill), abs=1e-9)
    # each instance: one job line or one whole idle line, plus an idle tail when deleted late, and one disk line
    by_line = {k: [r for r in recs if r.line == k] for k in ("instance", "idle", "disk")}
    assert len(by_line["instance"]) + idle_only == len(by_line["disk"]) == len(bill) - len(orphans)
    assert len(by_line["idle"]) == idle_only + tails and idle_only > 0 and tails > 0
    assert len({(r.resource, r.line) for r in recs if r.line != "idle"}) == len(recs) - len(by_line["idle"])


def test_a_pools_metered_energy_is_its_job_lines_plus_idle(any_store):
    """Node n1, 4 GPUs drawing 100 W each whether busy or idle, for 4 h (facility meter: PUE 1.2):
    1.6 kWh IT x 1.2 = 1.92 kWh metered. Job A holds GPUs 0-1 for 1 h (0.2 kWh IT), job B GPU 2 for 2 h
    (0.2 kWh IT): 0.48 kWh allocated; 1.44 kWh idle, unallocated."""
    day = datetime(2024, 3, 5, tzinfo=UTC)
    h = lambda x: day + timedelta(hours=x)  # noqa: E731
    mj = lambda w, s: int(w * s * 1000)  # noqa: E731  W x s -> mJ
    with any_store.session() as s:
        _node(s, "n1", "site", h(1), [0, 0, 0, 0], [100.0] * 4)
    a = onprem_job(any_store, "site", "n1", [0, 1], h(1))
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, a), repo.attempt_row(s, a, 1), h(1), "r")
        _node(s, "n1", "site", h(2), [mj(100, 3600)] * 4, [100.0] * 4)
    run_ranks(any_store, a, 1, h(1), [(0, 0, h(2))], cloud=False)
    b = onprem_job(any_store, "site", "n1", [2], h(2))
    with any_store.session() as s:
        assert lifecycle.mark_running(s, s.get(Job, b), repo.attempt_row(s, b, 1), h(2), "r")
        _node(s, "n1", "site", h(4), [mj(100, 3 * 3600)] * 4, [100.0] * 4)
    run_ranks(any_store, b, 1, h(2), [(0, 0, h(4))], cloud=False)
    with any_store.session() as s:
        recs = usage.usage_rows(s)
    e = reconcile_energy(recs, "site", 1.92, day, day + timedelta(days=1))
    assert (e.allocated_kwh, e.unallocated_kwh, e.unknown_lines) == (pytest.approx(0.48), pytest.approx(1.44), 0)
    with pytest.raises(ValueError, match=r"metered_kwh=-1: must be a finite number of kWh >= 0"):
        reconcile_energy(recs, "site", -1, day, day + timedelta(days=1))


def test_a_pools_idle_gpus_are_unallocated_lines_jobs_plus_idle_is_the_pools_capital(any_store):
    """Node n1 (pool "site", 4 GPUs, 0.50 USD per GPU-hour amortised) registered at 00:00. Job A holds GPUs 0-1
    from 01:00 to 02:00, job B GPU 2 from 02:00 to 04:00; job C is placed on GPU 3 at 04:00 but never starts
    (it times out at 04:30: held, not used). Over 00:00-05:00: 4 x 5 = 20 GPU-h of capital = 10.00 USD;
    A 2 GPU-h + B 2 GPU-h = 4 GPU-h = 2.00 USD on the jobs' amortised lines; idle per hour 4, 2, 3, 3, 4 =
    16 GPU-h = 8.00 USD on idle_amortised lines. 2.00 + 8.00 = 10.00."""
    from broker.service.reconciler import Reconciler
    from broker.service.settings import BrokerSettings

    day = datetime(2024, 3, 6, tzinfo=UTC)
    h = lambda x: day + timedelta(hours=x)  # noqa: E731
    with any_store.session() as s:
        _node(s, "n1", "site", h(0), [0, 0, 0, 0], [40.0] * 4)
    a = onprem_job(any_store, "site", "n1", [0, 1], h(1))
    run_ranks(any_store, a, 1, h(1), [(0, 0, h(2))], cloud=False)
    b = onprem_job(any_store, "site", "n1", [2], h(2))
    run_ranks(any_store, b, 1, h(2), [(0, 0, h(4))], cloud=False)
    c = onprem_job(any_store, "site", "n1", [3], h(4))
    with any_store.session() as s:
        assert lifecycle.requeue_lost(s, s.get(Job, c), h(4.5), "start deadline", "timed_out", max_attempts=5)
    rec = Reconciler(any_store, BrokerSettings())
    assert rec.meter_idle(h(5) + timedelta(minutes=7)) == 5  # the closed hours 00-04 since n1 registered
    assert rec.meter_idle(h(5) + timedelta(minutes=30)) == 0  # written once
    with any_store.session() as s:
        recs = usage.usage_rows(s, start=day, end=h(5))
    idle = [r for r in recs if r.line == "idle_amortised"]
    assert [(r.start, r.end, r.gpu_count, r.billed_s) for r in idle] == [
        (h(0), h(1), 4, 3600.0), (h(1), h(2), 4, 1800.0), (h(2), h(3), 4, 2700.0), (h(3), h(4), 4, 2700.0),
        (h(4), h(5), 4, 3600.0)]
    assert [r.billed_usd for r in idle] == pytest.approx([2.0, 1.0, 1.5, 1.5, 2.0], abs=1e-12)
    assert all((r.job_id, r.team, r.resource, r.pool, r.list_unit_price_usd, r.pricing_unit, r.energy_kwh) ==
               ("", "", "n1", "site", 0.5, "GPU-Hours", 0.0) for r in idle)
    jobs_usd = math.fsum(r.billed_usd for r in recs if r.line == "amortised")
    idle_usd = math.fsum(r.billed_usd for r in idle)
    assert (jobs_usd, idle_usd) == (pytest.approx(2.0), pytest.approx(8.0))
    assert jobs_usd + idle_usd == pytest.approx(4 * 5 * 0.5, abs=1e-12)  # the pool's capital over the 5 h
    # summaries: the idle line has its own group, and is not GPU time used
    groups, total = summarise(recs, "line")
    assert {g.key: round(g.cost_usd, 9) for g in groups}["idle_amortised"] == 8.0
    assert total.gpu_hours == pytest.approx(4.0)  # A's and B's energy lines only
    # the next hour is metered when it closes: 05:00-06:00 all idle, 4 GPU-h = 2.00 USD
    assert rec.meter_idle(h(6) + timedelta(seconds=1)) == 1


def test_a_bad_cur_file_is_named_by_row_and_column(tmp_path):
    p = tmp_path / "cur.csv"
    p.write_text("lineItem/ResourceId,lineItem/UsageStartDate\ni-1,2024-03-01T00:00:00Z\n")
    with pytest.raises(ReconcileError, match=r"cur.csv: column 'lineItem/UsageEndDate' missing"):
        read_cur_csv(p)
    head = ",".join(CUR_COLUMNS) + ",lineItem/CurrencyCode\n"
    p.write_text(head + "i-1,2024-03-01T00:00:00Z,2024-03-01T01:00:00Z,abc,USD\n")
    with pytest.raises(ReconcileError, match=r"cur.csv row 2 column 'lineItem/UnblendedCost': 'abc' is not a number"):
        read_cur_csv(p)
    p.write_text(head + "i-1,2024-03-01T02:00:00Z,2024-03-01T01:00:00Z,1.0,USD\n")
    with pytest.raises(ReconcileError, match=r"row 2 column 'lineItem/UsageEndDate': .* before the usage start"):
        read_cur_csv(p)
    p.write_text(head + "i-1,2024-03-01T00:00:00,2024-03-01T01:00:00Z,1.0,USD\n")
    with pytest.raises(ReconcileError, match=r"row 2 column 'lineItem/UsageStartDate': .* has no time zone"):
        read_cur_csv(p)
    p.write_text(head + "i-1,2024-03-01T00:00:00Z,2024-03-01T01:00:00Z,1.0,XYZ\n")
    with pytest.raises(UnknownCurrencyError, match="XYZ"):
        read_cur_csv(p)
    p.write_text(head + "i-1,2024-03-01T00:00:00Z,2024-03-01T01:00:00Z,10.0,EUR\n")
    [line] = read_cur_csv(p)
    assert line.usd == pytest.approx(10.0 * 1.0813)  # pricing.fx 2023 reference rate
