"""``GET /v1/usage/summary`` and ``GET /v1/usage/focus`` (issue #12, item 5) on PostgreSQL and SQLite.

Six ledger lines written by hand (two teams, AWS, GCP and an on-prem pool; one line of unknown cost; two
outside March), so every expected figure below is worked by hand:

==  =====  =======  ========  ============  =====  ========================  ======  =====  =====  ===========
#   team   project  provider  region        pool   start (UTC)               USD     GPU-h  kWh    kgCO2e
==  =====  =======  ========  ============  =====  ========================  ======  =====  =====  ===========
1   alpha  p1       aws       us-east-1     -      03-01 10:00, 45 s, 8 GPU  0.6     0.1    0.1    0.04
2   alpha  p2       gcp       europe-west4  -      03-02 23:30, 1 h, 4 GPU   10.0    4.0    2.0    0.5
3   beta   -        onprem    GB            lab    03-02 12:00, 2 h, 2 GPU   0.6     4.0    3.0    0.6   (energy)
4   beta   -        onprem    GB            lab    03-02 12:00, 2 h, 2 GPU   6.0     (0)    0      0     (amortised)
5   beta   -        onprem    GB            lab    03-05 00:00, 1 h, 1 GPU   ?       1.0    ?      ?     (unknown)
6   alpha  p1       aws       us-east-1     -      04-01 00:00 / 02-29 23:59:59 (outside [03-01, 04-01))
==  =====  =======  ========  ============  =====  ========================  ======  =====  =====  ===========

Line 1: 36 USD/h billed 60 s (the AWS minimum) = 0.6 USD. Line 3: 3 kWh at 0.2 USD/kWh. Line 4: 2 GPUs x 2 h x
1.5 USD/GPU-h = 6 USD; its GPU-hours are line 3's GPUs again, so not counted. Line 5: the pool was unknown:
cost, kWh and kgCO2e unknown (flagged), never counted as 0.
"""

from __future__ import annotations

import csv
import io
import json
import re
import uuid
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest
from fastapi.testclient import TestClient

from broker.focus import ALLOWED_VALUES, MANDATORY
from broker.service.api import create_app
from broker.service.settings import BrokerSettings, FinanceSettings
from broker.service.store import usage
from broker.service.tokens import create_token
from broker.usage import UsageRecord
from tests.conftest import auth

UTC = timezone.utc
ADMIN = "admin-" + uuid.uuid4().hex
ORG = "Example Lab Ltd"
MARCH = {"from": "2024-03-01", "to": "2024-04-01"}


def rec(n: int, team: str, start: datetime, run_s: float, **kw) -> UsageRecord:
    base = dict(job_id=f"job-{n:016x}", attempt=1, rank=0, line="instance", resource=f"i-{n:04d}", team=team,
                start=start, end=start + timedelta(seconds=run_s), gpu_type="A100", run_s=run_s, billed_s=run_s)
    base.update(kw)
    return UsageRecord(**base)


def ledger(alpha: str, beta: str) -> list[UsageRecord]:
    t = lambda d, h, m=0, s=0: datetime(2024, 3, d, h, m, s, tzinfo=UTC)  # noqa: E731
    modelled = dict(estimated=True, estimate_reasons=("power modelled",))
    onprem = dict(provider="onprem", region="GB", pool="lab", resource="node-1", gpu_count=2)
    return [
        rec(1, alpha, t(1, 10), 45, project="p1", provider="aws", region="us-east-1", zone="us-east-1a",
            instance_type="p4d.24xlarge", market="on_demand", gpu_count=8, billed_s=60, list_unit_price_usd=36.0,
            billed_usd=0.6, energy_kwh=0.1, carbon_kg=0.04, **modelled),
        rec(2, alpha, t(2, 23, 30), 3600, project="p2", provider="gcp", region="europe-west4",
            zone="europe-west4-a", instance_type="a2-highgpu-4g", market="spot", gpu_count=4,
            list_unit_price_usd=10.0, billed_usd=10.0, energy_kwh=2.0, carbon_kg=0.5, **modelled),
        rec(3, beta, t(2, 12), 7200, line="energy", pricing_unit="kWh", list_unit_price_usd=0.2, billed_usd=0.6,
            energy_kwh=3.0, carbon_kg=0.6, **onprem),
        rec(3, beta, t(2, 12), 7200, line="amortised", pricing_unit="GPU-Hours", list_unit_price_usd=1.5,
            billed_usd=6.0, energy_kwh=0.0, carbon_kg=0.0, **onprem),
        rec(5, beta, t(5, 0), 3600, line="energy", pricing_unit="kWh", list_unit_price_usd=None, billed_usd=None,
            energy_kwh=None, carbon_kg=None, estimated=True,
            estimate_reasons=("pool 'lab' not in the cluster file",), **dict(onprem, gpu_count=1)),
        rec(6, alpha, datetime(2024, 4, 1, tzinfo=UTC), 60, project="p1", provider="aws", region="us-east-1",
            gpu_count=8, list_unit_price_usd=36.0, billed_usd=0.6, energy_kwh=0.1, carbon_kg=0.04),
        rec(7, alpha, datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC), 60, project="p1", provider="aws",
            region="us-east-1", gpu_count=8, list_unit_price_usd=36.0, billed_usd=0.6, energy_kwh=0.1,
            carbon_kg=0.04),
    ]


@pytest.fixture
def world(any_store):
    alpha, beta = "alpha" + uuid.uuid4().hex[:6], "beta" + uuid.uuid4().hex[:6]
    with any_store.session() as s:
        assert usage.add_usage(s, ledger(alpha, beta), datetime(2024, 4, 2, tzinfo=UTC)) == 7
    app = create_app(any_store, BrokerSettings(admin_token=ADMIN, finance=FinanceSettings(
        organisation=ORG, billing_account_id="lab-0001", cloud_accounts={"aws": "123456789012"})))
    with TestClient(app) as c:
        yield {"c": c, "alpha": alpha, "beta": beta, "admin": auth(ADMIN),
               "alpha_auth": auth(create_token(any_store, alpha, label="t").token),
               "alpha_ro": auth(create_token(any_store, alpha, "read-only", label="t").token)}


def summary(w, who: str = "admin", **params):
    r = w["c"].get("/v1/usage/summary", params={**MARCH, **params}, headers=w[who])
    assert r.status_code == 200, r.text
    return r.json()


def figures(g: dict) -> tuple:
    return (g["key"], round(g["cost_usd"], 9), round(g["gpu_hours"], 9), round(g["energy_kwh"], 9),
            round(g["carbon_kg"], 9), g["lines"])


def test_summary_by_team_and_total(world):
    out = summary(world, by="team")
    a, b = world["alpha"], world["beta"]
    assert [figures(g) for g in out["groups"]] == [(a, 10.6, 4.1, 2.1, 0.54, 2), (b, 6.6, 5.0, 3.0, 0.6, 3)]
    beta = out["groups"][1]
    assert (beta["unpriced_lines"], beta["unknown_energy_lines"], beta["unknown_carbon_lines"],
            beta["estimated_lines"]) == (1, 1, 1, 1)
    assert figures(out["total"]) == (None, 17.2, 9.1, 5.1, 1.14, 5)
    assert out["total"]["estimated_lines"] == 3
    assert (out["start"], out["end"], out["team"]) == ("2024-03-01T00:00:00Z", "2024-04-01T00:00:00Z", None)


@pytest.mark.parametrize("by,expected", [
    ("project", [("p1", 0.6, 0.1, 0.1, 0.04, 1), ("p2", 10.0, 4.0, 2.0, 0.5, 1), (None, 6.6, 5.0, 3.0, 0.6, 3)]),
    ("provider", [("aws", 0.6, 0.1, 0.1, 0.04, 1), ("gcp", 10.0, 4.0, 2.0, 0.5, 1),
                  ("onprem", 6.6, 5.0, 3.0, 0.6, 3)]),
    ("region", [("GB", 6.6, 5.0, 3.0, 0.6, 3), ("europe-west4", 10.0, 4.0, 2.0, 0.5, 1),
                ("us-east-1", 0.6, 0.1, 0.1, 0.04, 1)]),
    ("pool", [("lab", 6.6, 5.0, 3.0, 0.6, 3), (None, 10.6, 4.1, 2.1, 0.54, 2)]),
    # the GCP line starts on 03-02 23:30: a line counts on the UTC day it starts
    ("day", [("2024-03-01", 0.6, 0.1, 0.1, 0.04, 1), ("2024-03-02", 16.6, 8.0, 5.0, 1.1, 3),
             ("2024-03-05", 0.0, 1.0, 0.0, 0.0, 1)]),
])
def test_summary_by_each_dimension(world, by, expected):
    out = summary(world, by=by)
    assert out["by"] == by
    assert [figures(g) for g in out["groups"]] == expected


def test_the_period_is_start_inclusive_end_exclusive(world):
    # [02-29 23:59:59, 03-01 10:00) holds line 7 only; [03-01 10:00, 03-01 10:00:01) line 1 only
    out = summary(world, **{"from": "2024-02-29T23:59:59Z", "to": "2024-03-01T10:00:00Z"})
    assert [figures(g) for g in out["groups"]] == [(world["alpha"], 0.6, round(8 * 60 / 3600, 9), 0.1, 0.04, 1)]
    out = summary(world, **{"from": "2024-03-01T11:00:00+01:00", "to": "2024-03-01T10:00:01"})  # naive = UTC
    assert out["total"]["lines"] == 1 and out["start"] == "2024-03-01T10:00:00Z"


def test_a_team_token_sees_its_own_team_only(world):
    for who in ("alpha_auth", "alpha_ro"):
        out = summary(world, who, by="provider")
        assert out["team"] == world["alpha"]
        assert [g["key"] for g in out["groups"]] == ["aws", "gcp"]  # never beta's on-prem lines
        assert figures(out["total"]) == (None, 10.6, 4.1, 2.1, 0.54, 2)
        r = world["c"].get("/v1/usage/summary", params={**MARCH, "team": world["beta"]}, headers=world[who])
        assert r.status_code == 403 and world["beta"] in r.json()["detail"]
        r = world["c"].get("/v1/usage/focus", params={**MARCH, "team": world["beta"]}, headers=world[who])
        assert r.status_code == 403
        text = world["c"].get("/v1/usage/focus", params=MARCH, headers=world[who]).text
        assert world["beta"] not in text and text.count(world["alpha"]) == 2
    # an admin may narrow to one team
    out = summary(world, team=world["beta"], by="team")
    assert [g["key"] for g in out["groups"]] == [world["beta"]] and out["team"] == world["beta"]


def test_no_token_is_401(world):
    assert world["c"].get("/v1/usage/summary", params=MARCH).status_code == 401
    assert world["c"].get("/v1/usage/focus", params=MARCH).status_code == 401


@pytest.mark.parametrize("params,field", [
    ({"by": "week"}, "by"),
    ({"from": "yesterday"}, "from"),
    ({"to": "2024-13-01"}, "to"),
    ({"from": "2024-04-01", "to": "2024-03-01"}, "to"),           # from after to
    ({"from": "2024-03-01", "to": "2024-03-01T00:00:00Z"}, "to"),  # an empty period
    ({"from": "9999-12-31T23:00:00-05:00"}, "from"),               # past year 9999 in UTC
    ({"team": "no spaces"}, "team"),
])
def test_bad_input_is_422_naming_the_field(world, params, field):
    for path in ("/v1/usage/summary", "/v1/usage/focus"):
        if path.endswith("focus") and "by" in params:
            continue
        r = world["c"].get(path, params={**MARCH, **params}, headers=world["admin"])
        assert r.status_code == 422, r.text
        [err] = r.json()["detail"]
        assert err["loc"] == ["query", field] and err["msg"].startswith(f"{field}="), err


def test_missing_period_is_422(world):
    r = world["c"].get("/v1/usage/summary", params={"to": "2024-04-01"}, headers=world["admin"])
    assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("from")


# ----------------------------------------------------------------------------- FOCUS 1.2

#: the Mandatory columns of FOCUS 1.2 as the specification names them (FOCUS_Spec v1.2, specification/columns:
#: "Feature level: Mandatory"), typed here from the spec, not from broker.focus
SPEC_MANDATORY = {
    "BilledCost": "Decimal", "BillingAccountId": "String", "BillingAccountName": "String",
    "BillingCurrency": "String", "BillingPeriodEnd": "Date/Time", "BillingPeriodStart": "Date/Time",
    "ChargeCategory": "String", "ChargeClass": "String", "ChargeDescription": "String",
    "ChargePeriodEnd": "Date/Time", "ChargePeriodStart": "Date/Time", "ContractedCost": "Decimal",
    "EffectiveCost": "Decimal", "InvoiceIssuerName": "String", "ListCost": "Decimal", "PricingQuantity": "Decimal",
    "PricingUnit": "String", "ProviderName": "String", "PublisherName": "String", "ServiceCategory": "String",
    "ServiceName": "String",
}
#: Mandatory columns that allow nulls (the rest must not be null)
SPEC_NULLABLE = {"BillingAccountName", "ChargeClass", "ChargeDescription", "PricingQuantity", "PricingUnit"}
SPEC_ALLOWED = {
    "ChargeCategory": {"Usage", "Purchase", "Tax", "Credit", "Adjustment"},
    "ChargeClass": {"Correction"},
    "ServiceCategory": {"AI and Machine Learning", "Analytics", "Business Applications", "Compute", "Databases",
                        "Developer Tools", "Multicloud", "Identity", "Integration", "Internet of Things",
                        "Management and Governance", "Media", "Migration", "Mobile", "Networking", "Security",
                        "Storage", "Web", "Other"},
}
DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def test_the_module_states_the_spec_columns():
    assert {c: t for c, (t, _) in MANDATORY.items()} == SPEC_MANDATORY
    assert {c for c, (_, null) in MANDATORY.items() if null} == SPEC_NULLABLE
    for col, allowed in SPEC_ALLOWED.items():
        assert set(ALLOWED_VALUES[col]) == allowed


def focus_frame(world, who: str = "admin", **params) -> tuple[pd.DataFrame, str, int]:
    r = world["c"].get("/v1/usage/focus", params={**MARCH, **params}, headers=world[who])
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    return pd.read_csv(io.StringIO(r.text)), r.text, int(r.headers["X-Fedbroker-Skipped-Lines"])


def test_focus_csv_loads_with_pandas_with_every_mandatory_column_typed_and_allowed(world):
    df, text, skipped = focus_frame(world)
    assert len(df) == 4 and skipped == 1  # line 5 has no known cost: not a FOCUS row; 6 and 7 outside March
    assert list(df.columns)[:len(SPEC_MANDATORY)] == sorted(SPEC_MANDATORY)  # FOCUS columns first
    custom = [c for c in df.columns if c not in SPEC_MANDATORY]
    first_x = min(i for i, c in enumerate(df.columns) if c.startswith("x_"))
    assert all(c.startswith("x_") for c in list(df.columns)[first_x:]) and custom  # extensions last
    for col, kind in SPEC_MANDATORY.items():
        assert col in df.columns, col
        s = df[col]
        if col not in SPEC_NULLABLE:
            assert s.notna().all(), col
        if kind == "Decimal":
            assert pd.api.types.is_float_dtype(s) or pd.api.types.is_integer_dtype(s), (col, s.dtype)
        elif kind == "Date/Time":
            assert s.map(lambda v: bool(DATETIME.match(v))).all(), (col, list(s))
            assert pd.to_datetime(s, utc=True).notna().all()
        else:
            assert s.dropna().map(lambda v: isinstance(v, str) and v != "").all(), col
        if col in SPEC_ALLOWED:
            assert set(s.dropna()) <= SPEC_ALLOWED[col], (col, set(s.dropna()))
    assert set(df["BillingCurrency"]) == {"USD"}
    # the rules between columns: PricingUnit null iff PricingQuantity null; ListCost = ListUnitPrice x quantity;
    # a charge period inside its billing period
    assert (df["PricingUnit"].isna() == df["PricingQuantity"].isna()).all()
    assert ((df["ListUnitPrice"] * df["PricingQuantity"] - df["ListCost"]).abs() < 1e-9).all()
    for a, b in (("BillingPeriodStart", "ChargePeriodStart"), ("ChargePeriodStart", "ChargePeriodEnd"),
                 ("ChargePeriodEnd", "BillingPeriodEnd")):
        assert (pd.to_datetime(df[a], utc=True) <= pd.to_datetime(df[b], utc=True)).all(), (a, b)
    # Tags: a JSON object of scalars
    for tags in df["Tags"]:
        t = json.loads(tags)
        assert set(t) == {"team", "project", "job"} and all(not isinstance(v, (dict, list)) for v in t.values())
    # numbers in FOCUS's numeric format: no exponent, no '+', no thousands separator
    header, *rows = list(csv.reader(io.StringIO(text)))
    for col in ("BilledCost", "ListCost", "PricingQuantity", "ConsumedQuantity"):
        i = header.index(col)
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", r[i]) for r in rows), col


def test_focus_rows_carry_the_hand_worked_values(world):
    df, _, _ = focus_frame(world)
    by_line = {(r["x_JobId"], r["x_UsageLine"]): r for _, r in df.iterrows()}
    aws = by_line[("job-0000000000000001", "instance")]
    assert (aws["BilledCost"], aws["EffectiveCost"], aws["ListUnitPrice"]) == (0.6, 0.6, 36.0)
    assert aws["ListCost"] == pytest.approx(0.6) and aws["ContractedCost"] == pytest.approx(0.6)
    assert aws["PricingQuantity"] == pytest.approx(60 / 3600) and aws["PricingUnit"] == "Hours"  # the 60 s minimum
    assert aws["ConsumedQuantity"] == pytest.approx(45 / 3600) and aws["ConsumedUnit"] == "Hours"  # what ran
    assert (aws["ChargePeriodStart"], aws["ChargePeriodEnd"]) == ("2024-03-01T10:00:00Z", "2024-03-01T10:00:45Z")
    assert (aws["BillingPeriodStart"], aws["BillingPeriodEnd"]) == ("2024-03-01T00:00:00Z", "2024-04-01T00:00:00Z")
    assert (aws["InvoiceIssuerName"], aws["ProviderName"], aws["PublisherName"]) == ("AWS", "AWS", "AWS")
    assert (str(aws["BillingAccountId"]), aws["ServiceName"], aws["ServiceCategory"]) == (
        "123456789012", "Amazon Elastic Compute Cloud", "Compute")
    assert (aws["ResourceId"], aws["RegionId"], aws["AvailabilityZone"], aws["PricingCategory"]) == (
        "i-0001", "us-east-1", "us-east-1a", "Standard")
    assert (aws["x_EnergyKilowattHours"], aws["x_CarbonKilogramsCo2e"], aws["x_Estimated"]) == (0.1, 0.04, True)
    assert json.loads(aws["Tags"]) == {"team": world["alpha"], "project": "p1", "job": "job-0000000000000001"}
    gcp = by_line[("job-0000000000000002", "instance")]
    assert (gcp["PricingCategory"], gcp["ProviderName"], gcp["ServiceName"]) == ("Dynamic", "Google Cloud",
                                                                                  "Compute Engine")
    assert gcp["BillingAccountId"] == "lab-0001"  # no GCP account set: the operator's
    assert gcp["ChargePeriodEnd"] == "2024-03-03T00:30:00Z" and gcp["BillingPeriodStart"] == "2024-03-01T00:00:00Z"
    energy = by_line[("job-0000000000000003", "energy")]
    assert (energy["InvoiceIssuerName"], energy["ProviderName"], energy["PublisherName"]) == (ORG, ORG, ORG)
    assert (energy["BillingAccountId"], energy["BillingAccountName"]) == ("lab-0001", ORG)
    assert (energy["PricingQuantity"], energy["PricingUnit"], energy["ListUnitPrice"]) == (3.0, "kWh", 0.2)
    assert energy["BilledCost"] == 0.6 and energy["ListCost"] == pytest.approx(0.6)
    assert (energy["x_EnergyKilowattHours"], energy["x_CarbonKilogramsCo2e"], energy["x_Pool"]) == (3.0, 0.6, "lab")
    assert pd.isna(energy["ChargeClass"]) and energy["ChargeCategory"] == "Usage"
    amortised = by_line[("job-0000000000000003", "amortised")]
    assert (amortised["PricingQuantity"], amortised["PricingUnit"], amortised["BilledCost"]) == (4.0, "GPU-Hours", 6.0)
    assert amortised["InvoiceIssuerName"] == ORG and json.loads(amortised["Tags"])["project"] is None


def test_the_sql_sums_equal_the_reference_summarise_on_random_lines(any_store):
    """``store.usage.usage_totals`` (one GROUP BY, what the API serves) against ``broker.usage.summarise`` (the
    reference, over the records read back) for every dimension, on 80 seeded random lines across a DST change
    and a month end, some of unknown cost/kWh/carbon."""
    import random

    from broker.usage import SUMMARY_DIMENSIONS, summarise, total_of

    rng = random.Random(5)
    t0 = datetime(2024, 3, 29, tzinfo=UTC)
    lines = []
    for i in range(80):
        start = t0 + timedelta(minutes=rng.randrange(0, 5 * 24 * 60), microseconds=rng.randrange(10**6))
        unknown = rng.random() < 0.2
        cloud = rng.random() < 0.5
        kw = dict(provider="aws", region=rng.choice(["us-east-1", "eu-west-1"]), market="spot",
                  instance_type="p3.8xlarge") if cloud else dict(
            provider="onprem", region="GB", pool=rng.choice(["lab", "hpc"]), line=rng.choice(["energy", "amortised"]))
        line = kw.get("line", "instance")
        kw["pricing_unit"] = {"instance": "Hours", "energy": "kWh", "amortised": "GPU-Hours"}[line]
        lines.append(rec(i, rng.choice(["a", "b", "c"]), start, rng.uniform(1, 9000), gpu_count=rng.randrange(1, 9),
                         project=rng.choice([None, "p1", "p2"]), list_unit_price_usd=1.0,
                         billed_usd=None if unknown else rng.uniform(-1, 50),
                         energy_kwh=None if unknown and line == "energy" else rng.uniform(0, 20),
                         carbon_kg=None if unknown else rng.uniform(0, 5), estimated=unknown,
                         estimate_reasons=("hour missing",) if unknown else (), **kw))
    with any_store.session() as s:
        assert usage.add_usage(s, lines, t0) == 80
    start, end = datetime(2024, 3, 30, tzinfo=UTC), datetime(2024, 4, 2, 12, tzinfo=UTC)
    with any_store.session() as s:
        period = usage.usage_rows(s, start=start, end=end)
        assert 20 < len(period) < 80
        for by in SUMMARY_DIMENSIONS:
            for team in (None, "b"):
                sql = usage.usage_totals(s, by, start, end, team=team)
                ref, ref_total = summarise([r for r in period if team is None or r.team == team], by)
                assert [g.key for g in sql] == [g.key for g in ref], by
                for a, b in zip([*sql, total_of(sql)], [*ref, ref_total]):
                    assert (a.lines, a.estimated_lines, a.unpriced_lines, a.unknown_energy_lines,
                            a.unknown_carbon_lines) == (b.lines, b.estimated_lines, b.unpriced_lines,
                                                        b.unknown_energy_lines, b.unknown_carbon_lines), (by, a.key)
                    for f in ("cost_usd", "gpu_hours", "energy_kwh", "carbon_kg"):
                        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-9, abs=1e-9), (by, a.key, f)


# ----------------------------------------------------------------------------- savings
@pytest.fixture
def rates():
    """Prices for the counterfactuals: A100 on AWS p4d.24xlarge at 32.77 USD/h for 8 GPUs (4.09625 USD/GPU-h)
    and on GCP a2-highgpu-1g spot at 1.20 USD/h (the cheapest: 1.20 USD/GPU-h); pool "lab" with A100 nodes at
    1.50 USD/GPU-h amortised."""
    from broker.model import CloudOffer, Market, Pool, PoolNode
    from broker.service import ledger as ledger_mod

    offers = (CloudOffer(provider="aws", region="us-east-1", zone="use1-az1", instance_type="p4d.24xlarge",
                         gpu_type="A100", gpu_count=8, gpu_memory_gb=40, market=Market.on_demand, usd_per_hour=32.77,
                         carbon_zone="X", pue=1.15),
              CloudOffer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-1g",
                         gpu_type="A100", gpu_count=1, gpu_memory_gb=40, market=Market.spot, usd_per_hour=1.2,
                         carbon_zone="X", pue=1.1))
    pools = (Pool(name="lab", carbon_zone="GB", price_zone="GB", pue=1.2, amortised_usd_per_gpu_hour=1.5,
                  nodes=(PoolNode(name="node-1", gpu_type="A100", gpu_count=2),)),)
    ledger_mod.install(ledger_mod.LedgerPrices.of(offers, pools, None))
    yield
    ledger_mod.install(None)


def test_savings_against_the_two_counterfactuals_hand_worked(world, rates):
    """March: units compared = alpha's AWS instance (8 GPU x 45 s = 0.1 GPU-h, 0.60 USD), alpha's GCP instance
    (4 GPU-h, 10.00 USD), beta's on-prem rank (2 GPU x 2 h = 4 GPU-h, energy 0.60 + amortised 6.00 USD); beta's
    rank 5 (energy cost unknown) is left out. 8.1 GPU-h, actual 17.20 USD.
    Cheapest cloud: 8.1 x 1.20 = 9.72 USD. On-prem: 1.50 amortised + the ledger's energy 0.60 USD / 4 GPU-h =
    0.15 -> 1.65 USD/GPU-h x 8.1 = 13.365 USD."""
    r = world["c"].get("/v1/usage/savings", params=MARCH, headers=world["admin"])
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["units"], out["not_compared_units"], out["not_compared_gpu_hours"]) == (3, 1, pytest.approx(1.0))
    assert out["gpu_hours"] == pytest.approx(8.1) and out["actual_usd"] == pytest.approx(17.2)
    assert out["cheapest_cloud_usd"] == pytest.approx(9.72) and out["onprem_only_usd"] == pytest.approx(13.365)
    assert out["saved_vs_cheapest_cloud_usd"] == pytest.approx(9.72 - 17.2)
    assert out["saved_vs_onprem_only_usd"] == pytest.approx(13.365 - 17.2)
    assert out["cloud_usd_per_gpu_hour"] == {"A100": pytest.approx(1.2)}
    assert out["onprem_usd_per_gpu_hour"] == {"A100": pytest.approx(1.65)}
    assert out["reasons"] == ["1 unit(s) left out: a line of unknown cost"]
    assert out["rate_notes"] == [
        "A100 cloud: 1.2000 USD/GPU-h, gcp:us-central1-a:a2-highgpu-1g:spot (1.2 USD/h, 1 GPU)",
        "A100 on-prem: 1.6500 USD/GPU-h = pool lab amortised 1.5 + energy 0.1500 (the ledger's 1 energy line(s), "
        "4.00 GPU-h)"]
    # alpha's own: 4.1 GPU-h, 10.60 USD actual; 4.92 on the cheapest cloud; 6.765 on-prem (the same rates)
    out = world["c"].get("/v1/usage/savings", params=MARCH, headers=world["alpha_ro"]).json()
    assert (out["team"], out["units"]) == (world["alpha"], 2)
    assert (out["actual_usd"], out["cheapest_cloud_usd"], out["onprem_only_usd"]) == (
        pytest.approx(10.6), pytest.approx(4.92), pytest.approx(6.765))
    r = world["c"].get("/v1/usage/savings", params={**MARCH, "team": world["beta"]}, headers=world["alpha_ro"])
    assert r.status_code == 403


def test_savings_count_a_slurm_pools_hours_and_a_live_gpu_type_missing_from_the_cluster_file(any_store):
    """July 2024 (no other test's lines): a Slurm pool ``hpc`` (no nodes in the cluster file: Slurm has them) ran
    1 x A100 for 1 h (energy 0.10 + amortised 1.00 USD), and agent pool ``local`` (its file says V100) has a
    registered H200 node that ran 1 x H200 for 2 h (energy 0.40 + amortised 3.00). cb5ea98 left both out ("A100
    on-prem: no pool has this type", "H200 on-prem: ..."). On-prem rates: hpc 1.00 + the ledger's energy 0.10 =
    1.10 USD/GPU-h for A100; local 1.50 + 0.20 = 1.70 for H200. Cloud: A100 1.20, H200 5.00 USD/GPU-h.
    3 GPU-h: actual 4.50; on-prem only 1.10 + 3.40 = 4.50 (saved exactly 0); cheapest cloud 1.20 + 10.00 = 11.20."""
    from broker.model import CloudOffer, Market, Pool, PoolNode
    from broker.service import ledger as ledger_mod

    offers = (CloudOffer(provider="gcp", region="us-central1", zone="us-central1-a", instance_type="a2-highgpu-1g",
                         gpu_type="A100", gpu_count=1, gpu_memory_gb=40, market=Market.spot, usd_per_hour=1.2,
                         carbon_zone="X", pue=1.1),
              CloudOffer(provider="aws", region="us-east-1", zone="use1-az1", instance_type="p5.48xlarge",
                         gpu_type="H200", gpu_count=8, gpu_memory_gb=141, market=Market.on_demand, usd_per_hour=40.0,
                         carbon_zone="X", pue=1.1))
    pools = (Pool(name="hpc", carbon_zone="GB", price_zone="GB", amortised_usd_per_gpu_hour=1.0, nodes=(),
                  kind="slurm", scheduler={"partition": "gpu"}),
             Pool(name="local", carbon_zone="GB", price_zone="GB", amortised_usd_per_gpu_hour=1.5,
                  nodes=(PoolNode(name="gpu-1", gpu_type="V100", gpu_count=4),)))
    team = "hpc" + uuid.uuid4().hex[:6]
    t = datetime(2024, 7, 2, 9, tzinfo=UTC)
    slurm = dict(provider="onprem", region="GB", pool="hpc", resource="slurm:42", gpu_count=1, gpu_type="A100")
    agent = dict(provider="onprem", region="GB", pool="local", resource="h200-1", gpu_count=1, gpu_type="H200")
    lines = [rec(60, team, t, 3600, line="energy", pricing_unit="kWh", list_unit_price_usd=0.2, billed_usd=0.1,
                 energy_kwh=0.5, carbon_kg=0.1, **slurm),
             rec(60, team, t, 3600, line="amortised", pricing_unit="GPU-Hours", list_unit_price_usd=1.0, billed_usd=1.0,
                 energy_kwh=0.0, carbon_kg=0.0, **slurm),
             rec(61, team, t, 7200, line="energy", pricing_unit="kWh", list_unit_price_usd=0.2, billed_usd=0.4,
                 energy_kwh=2.0, carbon_kg=0.4, **agent),
             rec(61, team, t, 7200, line="amortised", pricing_unit="GPU-Hours", list_unit_price_usd=1.5,
                 billed_usd=3.0, energy_kwh=0.0, carbon_kg=0.0, **agent)]
    with any_store.session() as s:
        usage.add_usage(s, lines, datetime(2024, 7, 3, tzinfo=UTC))
    any_store.heartbeat("h200-1", "local", "H200", 1, 141.0, [0], "agent-h200", now=t)
    ledger_mod.install(ledger_mod.LedgerPrices.of(offers, pools, None))
    try:
        app = create_app(any_store, BrokerSettings(admin_token=ADMIN, finance=FinanceSettings(organisation=ORG)))
        with TestClient(app) as c:
            r = c.get("/v1/usage/savings", params={"from": "2024-07-01", "to": "2024-08-01"}, headers=auth(ADMIN))
    finally:
        ledger_mod.install(None)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["units"], out["not_compared_units"], out["gpu_hours"]) == (2, 0, 3.0)
    assert out["onprem_usd_per_gpu_hour"] == {"A100": 1.1, "H200": 1.7}
    assert out["cloud_usd_per_gpu_hour"] == {"A100": 1.2, "H200": 5.0}
    assert (out["actual_usd"], out["onprem_only_usd"], out["cheapest_cloud_usd"]) == (4.5, 4.5, 11.2)
    assert (out["saved_vs_onprem_only_usd"], out["saved_vs_cheapest_cloud_usd"]) == (0.0, 6.7)
    assert out["reasons"] == []
    assert [n for n in out["rate_notes"] if "on-prem" in n] == [
        "A100 on-prem: 1.1000 USD/GPU-h = pool hpc amortised 1.0 + energy 0.1000 (the ledger's 1 energy line(s), "
        "1.00 GPU-h)",
        "H200 on-prem: 1.7000 USD/GPU-h = pool local amortised 1.5 + energy 0.2000 (the ledger's 1 energy line(s), "
        "2.00 GPU-h)"]
