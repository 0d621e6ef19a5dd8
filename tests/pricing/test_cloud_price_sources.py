"""Live cloud prices: AWS spot history and Price List through botocore's Stubber, the GCP Cloud Billing Catalog
through ``responses``, and re-pricing the bundled offers with fallback. No test reaches the network: the
Stubber answers every boto3 call (an unexpected call fails), ``responses`` refuses every unregistered URL."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import requests
import responses
from botocore.stub import Stubber
from responses import matchers

from pricing.catalog import load_offers
from pricing.cloud_price_sources import (AWS_ON_DEMAND_FILTERS, AWS_PRICE_LIST, AWS_SPOT, BUNDLED_CATALOG,
                                         GCP_BILLING_CATALOG, AwsPriceList, AwsSpotPrices, CloudPriceBook,
                                         GcpBillingCatalog, _aws_client, reprice_offers, step_to_hourly)
from pricing.offers import Market
from pricing.sources import RateLimited, SourceAuthError, SourceUnavailable
from tests.pricing.recorded import utc

H = 3600.0
SKUS_URL = "https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus"


@pytest.fixture(autouse=True)
def _fake_aws_credentials(monkeypatch):
    # the Stubber answers before any request is signed or sent; fake keys keep boto3's chain from looking further
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


# ------------------------------------------------------------------------------------------------ step rule
def test_step_to_hourly_time_weights_a_jump_inside_the_hour_and_flags_partial_hours():
    t0 = utc(2024, 6, 3, 10).timestamp()
    # 1.00 from 09:40, 2.00 from 11:20 (the jump), 1.20 from 12:45; fetched at 13:30
    c = step_to_hourly([t0 - 20 * 60, t0 + 80 * 60, t0 + 165 * 60], [1.0, 2.0, 1.2], start_s=t0, end_s=t0 + 5 * H,
                       until_s=t0 + 3.5 * H, zone="use1-az2", source="x")
    v = c.series.values
    assert v[0] == pytest.approx(1.0, rel=1e-12)
    assert v[1] == pytest.approx((20 * 1.0 + 40 * 2.0) / 60, rel=1e-12)  # 1.6667
    assert v[2] == pytest.approx((45 * 2.0 + 15 * 1.2) / 60, rel=1e-12)  # 1.8
    assert v[3] == pytest.approx(1.2, rel=1e-12)  # 13:00-13:30 only (fetched at 13:30)
    assert math.isnan(v[4])  # after the fetch: unknown
    assert c.estimated.tolist() == [False, False, False, True, False]
    assert c.series.unit == "USD/h"


def test_step_to_hourly_before_the_first_record_and_bad_prices():
    t0 = utc(2024, 6, 3, 10).timestamp()
    c = step_to_hourly([t0 + 30 * 60], [0.5], start_s=t0 - H, end_s=t0 + 2 * H, until_s=t0 + 2 * H, zone="z",
                       source="x")
    assert math.isnan(c.series.values[0])
    assert c.series.values[1:].tolist() == [0.5, 0.5] and c.estimated.tolist() == [False, True, False]
    with pytest.raises(ValueError, match="prices: 0.0 is not a price > 0"):
        step_to_hourly([t0], [0.0], start_s=t0, end_s=t0 + H, until_s=t0 + H, zone="z", source="x")


# ------------------------------------------------------------------------------------------------ AWS spot
def _rec(zone_id, zone, itype, price, t):
    return {"AvailabilityZone": zone, "AvailabilityZoneId": zone_id, "InstanceType": itype,
            "ProductDescription": "Linux/UNIX", "SpotPrice": price, "Timestamp": t}


def _spot_source(now):
    ec2 = _aws_client("ec2", "us-east-1", 5.0)
    stub = Stubber(ec2)
    return AwsSpotPrices(lambda region: ec2, clock=lambda: now), stub


def test_aws_spot_history_two_pages_and_a_spot_price_jump():
    start, end = utc(2024, 6, 3, 10), utc(2024, 6, 3, 14)
    now = utc(2024, 6, 3, 13, 30).timestamp()
    src, stub = _spot_source(now)
    base = {"StartTime": start, "EndTime": utc(2024, 6, 3, 13, 30), "InstanceTypes": ["p3.2xlarge"],
            "ProductDescriptions": ["Linux/UNIX"]}
    # newest first, as AWS answers; the 09:40 record is the price in force when the window opens
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
        _rec("use1-az2", "us-east-1a", "p3.2xlarge", "1.200000", utc(2024, 6, 3, 12, 45)),
        _rec("use1-az2", "us-east-1a", "p3.2xlarge", "2.000000", utc(2024, 6, 3, 11, 20)),
    ], "NextToken": "page-2"}, base)
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
        _rec("use1-az2", "us-east-1a", "p3.2xlarge", "1.000000", utc(2024, 6, 3, 9, 40)),
        _rec("use1-az4", "us-east-1b", "p3.2xlarge", "0.918000", utc(2024, 6, 2, 8)),
    ], "NextToken": ""}, {**base, "NextToken": "page-2"})
    with stub:
        got = src.history("us-east-1", ["p3.2xlarge"], start.timestamp(), end.timestamp())
    stub.assert_no_pending_responses()
    assert set(got) == {("use1-az2", "p3.2xlarge"), ("use1-az4", "p3.2xlarge")}
    a = got[("use1-az2", "p3.2xlarge")]
    assert a.series.start_s == start.timestamp() and a.origin[0] == AWS_SPOT
    assert a.series.values[:4] == pytest.approx([1.0, 100.0 / 60.0, 108.0 / 60.0, 1.2], rel=1e-12)
    assert a.estimated.tolist() == [False, False, False, True]
    assert got[("use1-az4", "p3.2xlarge")].series.values[:4] == pytest.approx([0.918] * 4, rel=1e-12)


@pytest.mark.parametrize("code,status,exc", [
    ("RequestLimitExceeded", 503, RateLimited),
    ("AuthFailure", 401, SourceAuthError),
    ("UnauthorizedOperation", 403, SourceAuthError),
    ("InternalError", 500, SourceUnavailable),
])
def test_aws_spot_errors_are_mapped_and_tried_once(code, status, exc):
    t = utc(2024, 6, 3, 10).timestamp()
    src, stub = _spot_source(t + H)
    stub.add_client_error("describe_spot_price_history", service_error_code=code, http_status_code=status,
                          service_message="secret-looking text AKIDEXAMPLE",
                          response_meta={"HTTPHeaders": {"retry-after": "7"}})
    with stub, pytest.raises(exc) as ei:
        src.history("us-east-1", ["p3.2xlarge"], t, t + H)
    stub.assert_no_pending_responses()  # one attempt: a second would find no stubbed answer and fail differently
    assert ei.value.status == status and code in str(ei.value) and "AKIDEXAMPLE" not in str(ei.value)
    if exc is RateLimited:
        assert ei.value.retry_after_s == 7.0


def test_aws_spot_unreadable_price_is_unavailable():
    t = utc(2024, 6, 3, 10).timestamp()
    src, stub = _spot_source(t + H)
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
        _rec("use1-az2", "us-east-1a", "p3.2xlarge", "0.000000", utc(2024, 6, 3, 9))]})
    with stub, pytest.raises(SourceUnavailable, match="SpotPrice='0.000000'"):
        src.history("us-east-1", ["p3.2xlarge"], t, t + H)


# ------------------------------------------------------------------------------------------------ AWS price list
def _price_doc(itype, region, usd, location="US East (N. Virginia)"):
    """One ``PriceList`` entry as the Price List Query API returns it (a JSON string, aws_v1 format)."""
    sku = "JRTCKXETXF" if region == "us-east-1" else "A7N2Z4N3RP"
    return json.dumps({
        "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": {
            "enhancedNetworkingSupported": "Yes", "memory": "61 GiB", "vcpu": "8", "capacitystatus": "Used",
            "locationType": "AWS Region", "storage": "EBS only", "instanceFamily": "GPU instance",
            "operatingSystem": "Linux", "regionCode": region, "physicalProcessor": "Intel Xeon E5-2686 v4 (Broadwell)",
            "gpu": "1", "gpuMemory": "16 GiB", "usagetype": "BoxUsage:" + itype, "tenancy": "Shared",
            "normalizationSizeFactor": "16", "instanceType": itype, "location": location, "servicecode": "AmazonEC2",
            "licenseModel": "No License required", "preInstalledSw": "NA", "operation": "RunInstances",
            "servicename": "Amazon Elastic Compute Cloud"}},
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {f"{sku}.JRTCKXETXF": {
                "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                    "unit": "Hrs", "endRange": "Inf", "description": f"${usd} per On Demand Linux {itype} Instance Hour",
                    "appliesTo": [], "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7", "beginRange": "0",
                    "pricePerUnit": {"USD": f"{usd:.10f}"}}},
                "sku": sku, "effectiveDate": "2024-06-01T00:00:00Z", "offerTermCode": "JRTCKXETXF",
                "termAttributes": {}}},
            "Reserved": {f"{sku}.4NA7Y494T4": {
                "priceDimensions": {f"{sku}.4NA7Y494T4.6YS6EN2CT7": {
                    "unit": "Hrs", "endRange": "Inf", "description": "Linux/UNIX (Amazon VPC), p3.2xlarge reserved",
                    "appliesTo": [], "rateCode": f"{sku}.4NA7Y494T4.6YS6EN2CT7", "beginRange": "0",
                    "pricePerUnit": {"USD": "1.9580000000"}}},
                "sku": sku, "effectiveDate": "2024-06-01T00:00:00Z", "offerTermCode": "4NA7Y494T4",
                "termAttributes": {"LeaseContractLength": "1yr", "OfferingClass": "standard",
                                   "PurchaseOption": "No Upfront"}}}},
        "version": "20240601000000", "publicationDate": "2024-06-01T00:00:00Z"})


def _filters(itype):
    return [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": itype}] + [
        {"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in AWS_ON_DEMAND_FILTERS]


def test_aws_price_list_reads_the_nested_on_demand_price_over_pages():
    pricing = _aws_client("pricing", "us-east-1", 5.0)
    assert pricing.meta.region_name == "us-east-1"
    stub = Stubber(pricing)
    params = {"ServiceCode": "AmazonEC2", "Filters": _filters("p3.2xlarge"), "FormatVersion": "aws_v1"}
    stub.add_response("get_products", {"FormatVersion": "aws_v1", "NextToken": "n2",
                                       "PriceList": [_price_doc("p3.2xlarge", "us-east-1", 3.06)]}, params)
    stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [
        _price_doc("p3.2xlarge", "eu-west-1", 3.305, "EU (Ireland)"),
        _price_doc("p3.2xlarge", "ap-northeast-1", 4.194, "Asia Pacific (Tokyo)")]}, {**params, "NextToken": "n2"})
    with stub:
        got = AwsPriceList(pricing).on_demand(["p3.2xlarge"], regions=["us-east-1", "eu-west-1"])
    stub.assert_no_pending_responses()
    assert got == {("us-east-1", "p3.2xlarge"): 3.06, ("eu-west-1", "p3.2xlarge"): 3.305}


def test_aws_price_list_throttling_auth_and_unreadable_document():
    pricing = _aws_client("pricing", "us-east-1", 5.0)
    stub = Stubber(pricing)
    stub.add_client_error("get_products", service_error_code="ThrottlingException", http_status_code=400)
    stub.add_client_error("get_products", service_error_code="AccessDeniedException", http_status_code=400)
    stub.add_response("get_products", {"PriceList": ['{"product": {"attributes": {"regionCode": "us-east-1"}}}']})
    src = AwsPriceList(pricing)
    with stub:
        with pytest.raises(RateLimited) as e1:
            src.on_demand(["p3.2xlarge"])
        assert e1.value.retry_after_s is None
        with pytest.raises(SourceAuthError, match="AccessDeniedException"):
            src.on_demand(["p3.2xlarge"])
        with pytest.raises(SourceUnavailable, match="unreadable price document for 'p3.2xlarge'"):
            src.on_demand(["p3.2xlarge"])
    stub.assert_no_pending_responses()


# ------------------------------------------------------------------------------------------------ GCP catalog
def _sku(sku_id, desc, usage, units, nanos, unit="h", regions=("us-central1",), group="GPU"):
    """One ``services.skus.list`` entry as the Cloud Billing Catalog API documents it."""
    return {"name": f"services/6F81-5844-456A/skus/{sku_id}", "skuId": sku_id, "description": desc,
            "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                         "resourceGroup": group, "usageType": usage},
            "serviceRegions": list(regions),
            "pricingInfo": [{"summary": "", "effectiveTime": "2026-11-30T08:12:05.123Z",
                             "pricingExpression": {"usageUnit": unit, "displayQuantity": 1,
                                                   "usageUnitDescription": "hour" if unit == "h" else "gibibyte hour",
                                                   "baseUnit": "s" if unit == "h" else "By.s",
                                                   "baseUnitDescription": "second",
                                                   "baseUnitConversionFactor": 3600,
                                                   "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                                                       "currencyCode": "USD", "units": str(units), "nanos": nanos}}]},
                             "currencyConversionRate": 1}],
            "serviceProviderName": "Google", "geoTaxonomy": {"type": "REGIONAL", "regions": list(regions)}}


PAGE1 = {"skus": [
    _sku("0A1B-T4OD", "Nvidia Tesla T4 GPU running in Americas", "OnDemand", 0, 400000000),
    _sku("1C2D-N1C", "N1 Predefined Instance Core running in Americas", "OnDemand", 0, 31611000, group="N1Standard"),
    _sku("2E3F-N1R", "N1 Predefined Instance Ram running in Americas", "OnDemand", 0, 4237000, unit="GiBy.h",
         group="N1Standard"),
    _sku("3A4B-CUD", "Commitment v1: Nvidia Tesla T4 GPU in Americas for 1 Year", "Commit1Yr", 0, 220000000),
], "nextPageToken": "tok-2"}
PAGE2 = {"skus": [
    _sku("4C5D-T4SP", "Spot Preemptible Nvidia Tesla T4 GPU running in Americas", "Preemptible", 0, 140000000),
    _sku("5E6F-N1CS", "Spot Preemptible N1 Predefined Instance Core running in Americas", "Preemptible", 0, 6655000,
         group="N1Standard"),
    _sku("6A7B-N1RS", "Spot Preemptible N1 Predefined Instance Ram running in Americas", "Preemptible", 0, 892000,
         unit="GiBy.h", group="N1Standard"),
    _sku("7C8D-A100", "Nvidia Tesla A100 GPU running in Americas", "OnDemand", 2, 933908000,
         regions=("us-central1", "us-east1")),
    _sku("8E9F-EGRS", "Network Internet Egress from Americas to Americas", "OnDemand", 0, 120000000, unit="GiBy",
         group="PremiumInternetEgress"),
], "nextPageToken": ""}


def _register_pages(rsps):
    q = {"pageSize": "5000", "currencyCode": "USD"}
    rsps.get(SKUS_URL, json=PAGE1, match=[matchers.query_param_matcher(q)])
    rsps.get(SKUS_URL, json=PAGE2, match=[matchers.query_param_matcher({**q, "pageToken": "tok-2"})])


@responses.activate
def test_gcp_skus_two_pages_units_and_nanos():
    _register_pages(responses)
    rates = GcpBillingCatalog(session=requests.Session()).rates()
    assert rates.rates == {
        ("gpu", "T4", "us-central1", Market.on_demand): 0.4,
        ("cpu", "n1", "us-central1", Market.on_demand): 0.031611,
        ("ram", "n1", "us-central1", Market.on_demand): 0.004237,
        ("gpu", "T4", "us-central1", Market.spot): 0.14,
        ("cpu", "n1", "us-central1", Market.spot): 0.006655,
        ("ram", "n1", "us-central1", Market.spot): 0.000892,
        ("gpu", "A100", "us-central1", Market.on_demand): 2.933908,
        ("gpu", "A100", "us-east1", Market.on_demand): 2.933908,
    }
    assert rates.skipped == {"usage type not spot or on-demand": 1, "not a GPU, vCPU or RAM SKU": 1}
    # n1-standard-4 (4 vCPU, 15 GiB in the bundled catalog) + one T4
    assert rates.instance_price("n1-standard-4+T4x1", "us-central1", "on_demand") == pytest.approx(
        4 * 0.031611 + 15 * 0.004237 + 0.4, rel=1e-12)  # 0.589999
    assert rates.instance_price("n1-standard-4+T4x1", "us-central1", "spot") == pytest.approx(
        4 * 0.006655 + 15 * 0.000892 + 0.14, rel=1e-12)  # 0.1800
    assert math.isnan(rates.instance_price("a2-highgpu-1g", "us-central1", "on_demand"))  # no A2 core/RAM SKU
    assert [c.request.params.get("pageToken") for c in responses.calls] == [None, "tok-2"]


@responses.activate
@pytest.mark.parametrize("status,headers,exc", [(429, {"Retry-After": "30"}, RateLimited),
                                                (403, {}, SourceAuthError), (503, {}, SourceUnavailable)])
def test_gcp_errors_are_mapped(status, headers, exc):
    responses.get(SKUS_URL, status=status, headers=headers, json={"error": {"code": status}})
    with pytest.raises(exc) as ei:
        GcpBillingCatalog(session=requests.Session()).skus()
    assert ei.value.status == status
    if exc is RateLimited:
        assert ei.value.retry_after_s == 30.0


def test_gcp_without_credentials_is_an_auth_error(monkeypatch):
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    def no_creds(scopes=None):
        assert scopes == ["https://www.googleapis.com/auth/cloud-billing.readonly"]
        raise DefaultCredentialsError("Your default credentials were not found.")

    monkeypatch.setattr(google.auth, "default", no_creds)
    with pytest.raises(SourceAuthError, match="no Google credentials in the google.auth chain"):
        GcpBillingCatalog().skus()


@responses.activate
def test_gcp_credentials_that_cannot_be_refreshed_are_an_auth_error():
    from google.auth.exceptions import RefreshError

    class Refusing(requests.Session):
        def get(self, *a, **kw):
            raise RefreshError("invalid_grant: Token has been expired or revoked.")

    with pytest.raises(SourceAuthError, match="RefreshError") as ei:
        GcpBillingCatalog(session=Refusing()).skus()
    assert "invalid_grant" not in str(ei.value)


def test_aws_spot_window_in_the_future_is_a_clear_error():
    t = utc(2024, 6, 3, 10).timestamp()
    src, _ = _spot_source(t)
    with pytest.raises(ValueError, match="start_s=.*no past hour"):
        src.history("us-east-1", ["p3.2xlarge"], t + H, t + 2 * H)


# ------------------------------------------------------------------------------------------------ re-pricing
def _offers():
    want = {"aws:use1-az1:p3.2xlarge:spot", "aws:use1-az2:p3.2xlarge:spot", "aws:use1-az1:p3.2xlarge:on_demand",
            "gcp:us-central1-a:n1-standard-4+T4x1:on_demand", "gcp:us-central1-a:a2-highgpu-1g:on_demand"}
    got = {o.offer_id: o for o in load_offers().offers if o.offer_id in want}
    assert set(got) == want
    return [got[k] for k in sorted(want)]


@responses.activate
def test_reprice_offers_live_where_known_bundled_otherwise():
    _register_pages(responses)
    t0 = utc(2024, 6, 3, 10).timestamp()
    now = t0 + 1.5 * H  # 11:30, in the hour of the jump
    spot = step_to_hourly([t0 - 20 * 60, t0 + 80 * 60], [1.0, 2.0], start_s=t0, end_s=t0 + 2 * H, until_s=now,
                          zone="use1-az2", source=AWS_SPOT)
    zero = step_to_hourly([t0], [1.0], start_s=t0, end_s=t0 + H, until_s=t0 + H, zone="use1-az1", source=AWS_SPOT)
    book = CloudPriceBook(aws_spot={("use1-az2", "p3.2xlarge"): spot, ("use1-az1", "p3.2xlarge"): zero},
                          aws_spot_fetched_s=now - 60,
                          aws_on_demand={("us-east-1", "p3.2xlarge"): 3.06 * 1.1}, aws_on_demand_fetched_s=now - 3600,
                          gcp=GcpBillingCatalog(session=requests.Session()).rates(), gcp_fetched_s=now - 7200)
    out = {o.offer_id: (o, why) for o, why in reprice_offers(_offers(), book, now)}
    o, why = out["aws:use1-az2:p3.2xlarge:spot"]
    assert o.usd_per_hour == pytest.approx((20 * 1.0 + 10 * 2.0) / 30, rel=1e-12)  # 11:00-11:30: 1.3333
    assert (why.price_source, why.age_s, why.estimated, why.fallback) == (AWS_SPOT, 60.0, True, False)
    o, why = out["aws:use1-az1:p3.2xlarge:spot"]  # the book's series ends before now: bundled catalog kept
    assert o.usd_per_hour == 0.3644 and why.fallback and why.price_source == BUNDLED_CATALOG and why.age_s is None
    o, why = out["aws:use1-az1:p3.2xlarge:on_demand"]
    assert o.usd_per_hour == pytest.approx(3.366, rel=1e-12) and why.price_source == AWS_PRICE_LIST
    assert why.age_s == 3600.0
    o, why = out["gcp:us-central1-a:n1-standard-4+T4x1:on_demand"]
    assert o.usd_per_hour == pytest.approx(0.589999, rel=1e-12) and why.price_source == GCP_BILLING_CATALOG
    o, why = out["gcp:us-central1-a:a2-highgpu-1g:on_demand"]  # no A2 core/RAM rate: never a partial sum, never 0
    assert o.usd_per_hour == 3.67339 and why.fallback
    assert all(o.usd_per_hour > 0 for o, _ in out.values())


def test_reprice_with_an_empty_book_keeps_every_bundled_price():
    offers = _offers()
    out = reprice_offers(offers, CloudPriceBook(), utc(2024, 6, 3, 10).timestamp())
    assert [o for o, _ in out] == offers and all(w.price_source == BUNDLED_CATALOG for _, w in out)
    assert np.all([o.usd_per_hour > 0 for o, _ in out])
