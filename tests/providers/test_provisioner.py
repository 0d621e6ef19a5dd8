"""providers.provisioner: the failover rules of ARCHITECTURE.md §5 with scripted fake adapters (no SDK here;
the AWS adapter under failover against moto is in test_aws.py)."""

from __future__ import annotations

import pytest

from providers.base import (
    MANAGED_TAG,
    Compute,
    FailoverHistory,
    InstanceInfo,
    InstanceRequest,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    SupportsQuotaPreflight,
    Throttled,
    Unsupported,
    idempotency_token,
)
from providers.provisioner import OfferOption, ProvisioningFailed, provision_with_failover, quota_scope


class FakeCompute(Compute):
    """Answers ``launch`` from a script: offer id -> list of outcomes (an exception to raise, or "ok"),
    consumed in order; the last outcome repeats. Logs every call into the shared ``calls`` list."""

    def __init__(self, name: str, script: dict[str, list], calls: list):
        self.name = name
        self.script = {k: list(v) for k, v in script.items()}
        self.calls = calls
        self.requests: list[InstanceRequest] = []

    def launch(self, req: InstanceRequest) -> InstanceInfo:
        self.calls.append(("create", req.offer_id))
        self.requests.append(req)
        outcomes = self.script.get(req.offer_id, ["ok"])
        out = outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]
        if isinstance(out, BaseException):
            raise out
        state = "terminated" if out == "terminated" else "pending"
        return InstanceInfo(self.name, f"i-{len(self.requests)}", req.zone, req.instance_type, state, "10.0.0.9",
                            dict(req.tags))

    def describe(self, instance_id, zone):  # pragma: no cover - not used
        raise NotImplementedError

    def terminate(self, instance_id, zone):  # pragma: no cover - not used
        raise NotImplementedError

    def list_managed(self, broker_id):  # pragma: no cover - not used
        return []


class PreflightCompute(FakeCompute, SupportsQuotaPreflight):
    def __init__(self, name, script, calls, blocked: set[str]):
        super().__init__(name, script, calls)
        self.blocked = blocked

    def preflight(self, req):
        self.calls.append(("preflight", req.offer_id))
        if req.offer_id in self.blocked:
            raise QuotaExceeded("L-DB2E81BA: quota 0", req.offer_id, "L-DB2E81BA")


def opt(zone="us-east-1a", itype="g5.xlarge", market="spot", provider="aws", region=None, gpu="A10G"):
    region = region or (zone[:-1] if provider == "aws" else zone.rsplit("-", 1)[0])
    return OfferOption(provider, region, zone, itype, market, gpu, 1)


def run(options, computes, calls, **kw):
    history = FailoverHistory()

    def intent(req):
        calls.append(("intent", req.offer_id))

    kw.setdefault("sleep", lambda s: pytest.fail(f"unexpected sleep {s}"))
    chosen, info = provision_with_failover("job-1", 2, 0, "team-a", options, computes,
                                           lambda o: f"#!/bin/bash\n# {o.offer_id}\n", "broker-1", history, intent,
                                           **kw)
    return chosen, info, history


def summary(history):
    return [(a.option, a.error) for a in history.attempts]


A = "aws:us-east-1a:g5.xlarge:spot"
B = "aws:us-east-1b:g5.xlarge:spot"


def test_capacity_error_in_zone_a_moves_to_zone_b_with_the_intent_before_each_create():
    calls = []
    aws = FakeCompute("aws", {A: [NoCapacity("InsufficientInstanceCapacity", A, "InsufficientInstanceCapacity")]},
                      calls)
    options = [opt("us-east-1a"), opt("us-east-1b")]

    chosen, info, history = run(options, {"aws": aws}, calls)

    assert chosen is options[1]
    assert (info.zone, info.instance_id, info.state) == ("us-east-1b", "i-2", "pending")
    assert summary(history) == [(A, "NoCapacity"), (B, None)]
    assert history.attempts[0].message == "InsufficientInstanceCapacity"
    assert calls == [("intent", A), ("create", A), ("intent", B), ("create", B)]
    # each create carries the derived token, our tags and the option's user data
    req_a, req_b = aws.requests
    assert req_b.token == idempotency_token("job-1", 2, B, 0) != req_a.token
    assert req_b.tags == {MANAGED_TAG: "broker-1", "fedbroker-job": "job-1", "fedbroker-attempt": "2",
                          "fedbroker-rank": "0", "fedbroker-team": "team-a"}
    assert (req_b.user_data, req_b.region, req_b.market, req_b.gpu_type) == (f"#!/bin/bash\n# {B}\n", "us-east-1",
                                                                              "spot", "A10G")


def test_unsupported_is_excluded_and_the_next_option_tried():
    calls = []
    aws = FakeCompute("aws", {A: [Unsupported("not in zone", A, "Unsupported")]}, calls)
    chosen, _, history = run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls)
    assert chosen.zone == "us-east-1b"
    assert summary(history) == [(A, "Unsupported"), (B, None)]


def test_quota_error_is_not_retried_and_blocks_its_provider_market_family():
    calls = []
    g_spot_b = "aws:us-east-1b:g5.2xlarge:spot"
    g_od = "aws:us-east-1a:g5.xlarge:on_demand"
    gcp = "gcp:us-central1-a:g2-standard-4:spot"
    aws = FakeCompute("aws", {A: [QuotaExceeded("VcpuLimitExceeded", A, "VcpuLimitExceeded")],
                              g_od: [NoCapacity("none", g_od, "InsufficientInstanceCapacity")]}, calls)
    gcp_c = FakeCompute("gcp", {}, calls)
    options = [opt("us-east-1a"), opt("us-east-1b", "g5.2xlarge"), opt("us-east-1a", market="on_demand"),
               opt("us-central1-a", "g2-standard-4", provider="gcp", gpu="L4")]

    chosen, info, history = run(options, {"aws": aws, "gcp": gcp_c}, calls)

    # the quota option is called once; the other spot G option of aws in that region is never called;
    # on-demand (another quota) is still tried; then GCP
    assert calls == [("intent", A), ("create", A), ("intent", g_od), ("create", g_od), ("intent", gcp),
                     ("create", gcp)]
    assert ("create", g_spot_b) not in calls
    assert summary(history) == [(A, "QuotaExceeded"), (g_od, "NoCapacity"), (gcp, None)]
    assert chosen is options[3] and info.provider == "gcp"


def test_quota_block_is_per_region():
    calls = []
    west = "aws:us-west-2a:g5.xlarge:spot"
    aws = FakeCompute("aws", {A: [QuotaExceeded("VcpuLimitExceeded", A, "VcpuLimitExceeded")]}, calls)
    chosen, _, history = run([opt("us-east-1a"), opt("us-east-1b"), opt("us-west-2a")], {"aws": aws}, calls)
    assert summary(history) == [(A, "QuotaExceeded"), (west, None)]
    assert chosen.zone == "us-west-2a"


def test_preflight_quota_error_skips_the_create_and_blocks_the_scope():
    calls = []
    aws = PreflightCompute("aws", {}, calls, blocked={A})
    options = [opt("us-east-1a"), opt("us-east-1b"), opt("us-east-1a", market="on_demand")]
    chosen, _, history = run(options, {"aws": aws}, calls)
    od = "aws:us-east-1a:g5.xlarge:on_demand"
    assert calls == [("preflight", A), ("preflight", od), ("intent", od), ("create", od)]
    assert summary(history) == [(A, "QuotaExceeded"), (od, None)]
    assert chosen is options[2]


def test_throttling_backs_off_exactly_then_succeeds_on_the_same_option():
    calls, sleeps = [], []
    thr = [Throttled("RequestLimitExceeded", A, "RequestLimitExceeded") for _ in range(3)]
    aws = FakeCompute("aws", {A: [*thr, "ok"]}, calls)

    chosen, info, history = run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls, sleep=sleeps.append)

    assert sleeps == [1, 2, 4]
    assert chosen.zone == "us-east-1a" and info.zone == "us-east-1a"
    assert calls == [("intent", A)] + [("create", A)] * 4  # one intent: the retries reuse its token
    assert len({r.token for r in aws.requests}) == 1
    assert summary(history) == [(A, "Throttled")] * 3 + [(A, None)]


def test_throttling_uses_retry_after_and_gives_up_on_the_option_after_the_retries():
    calls, sleeps = [], []
    aws = FakeCompute("aws", {A: [Throttled("slow down", A, "Throttling", retry_after_s=7.5)]}, calls)
    chosen, _, history = run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls, sleep=sleeps.append,
                             max_throttle_retries=2)
    assert sleeps == [7.5, 7.5]
    assert calls == [("intent", A)] + [("create", A)] * 3 + [("intent", B), ("create", B)]
    assert summary(history) == [(A, "Throttled")] * 3 + [(B, None)]
    assert chosen.zone == "us-east-1b"


def test_backoff_is_capped():
    calls, sleeps = [], []
    aws = FakeCompute("aws", {A: [Throttled("t", A, "Throttling")] * 8 + ["ok"]}, calls)
    run([opt("us-east-1a")], {"aws": aws}, calls, sleep=sleeps.append, max_throttle_retries=8, throttle_max_s=10)
    assert sleeps == [1, 2, 4, 8, 10, 10, 10, 10]


def test_all_options_failing_raises_with_the_full_history():
    calls = []
    c = "aws:us-east-1c:g5.xlarge:spot"
    g = "gcp:us-central1-a:g2-standard-4:spot"
    aws = FakeCompute("aws", {A: [NoCapacity("no", A, "InsufficientInstanceCapacity")],
                              B: [Unsupported("not here", B, "Unsupported")],
                              c: [ProviderError("InternalError", c, "InternalError")]}, calls)
    gcp = FakeCompute("gcp", {g: [NoCapacity("ZONE_RESOURCE_POOL_EXHAUSTED", g, "ZONE_RESOURCE_POOL_EXHAUSTED")]},
                      calls)
    options = [opt("us-east-1a"), opt("us-east-1b"), opt("us-east-1c"),
               opt("us-central1-a", "g2-standard-4", provider="gcp", gpu="L4")]

    with pytest.raises(ProvisioningFailed) as ei:
        run(options, {"aws": aws, "gcp": gcp}, calls)

    err = ei.value
    assert isinstance(err, ProviderError) and err.code == "AllOptionsFailed"
    assert summary(err.history) == [(A, "NoCapacity"), (B, "Unsupported"), (c, "ProviderError"), (g, "NoCapacity")]
    assert [a["option"] for a in err.history.to_json()] == [A, B, c, g]
    assert err.skipped == []
    assert "all 4 options failed" in str(err)


def test_quota_skips_are_reported_when_everything_fails():
    calls = []
    aws = FakeCompute("aws", {A: [QuotaExceeded("q", A, "VcpuLimitExceeded")]}, calls)
    with pytest.raises(ProvisioningFailed) as ei:
        run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls)
    assert summary(ei.value.history) == [(A, "QuotaExceeded")]
    assert ei.value.skipped == [B]
    assert calls == [("intent", A), ("create", A)]


def test_unknown_errors_stop_after_three_in_total():
    calls = []
    opts = [opt(f"us-east-1{z}") for z in "abcde"]
    aws = FakeCompute("aws", {o.offer_id: [ProviderError("InternalError", o.offer_id, "InternalError")]
                              for o in opts}, calls)
    with pytest.raises(ProvisioningFailed) as ei:
        run(opts, {"aws": aws}, calls)
    assert ei.value.code == "TooManyErrors"
    assert [a.option for a in ei.value.history.attempts] == [o.offer_id for o in opts[:3]]
    assert [c for c in calls if c[0] == "create"] == [("create", o.offer_id) for o in opts[:3]]


def test_instance_terminated_at_launch_counts_as_unknown_and_moves_on():
    calls = []
    aws = FakeCompute("aws", {A: ["terminated"]}, calls)
    chosen, _, history = run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls)
    assert summary(history) == [(A, "ProviderError"), (B, None)]
    assert chosen.zone == "us-east-1b"


def test_an_option_without_an_adapter_is_unsupported():
    calls = []
    g = "gcp:us-central1-a:g2-standard-4:spot"
    chosen, _, history = run([opt("us-central1-a", "g2-standard-4", provider="gcp"), opt("us-east-1a")],
                             {"aws": FakeCompute("aws", {}, calls)}, calls)
    assert summary(history) == [(g, "Unsupported"), (A, None)]
    assert chosen.provider == "aws"


def test_a_bug_in_an_adapter_propagates():
    calls = []
    aws = FakeCompute("aws", {A: [KeyError("boom")]}, calls)
    with pytest.raises(KeyError):
        run([opt("us-east-1a"), opt("us-east-1b")], {"aws": aws}, calls)


def test_cloud_offers_are_accepted_and_returned_as_given():
    from broker.model import CloudOffer, Market

    offer = CloudOffer(provider="aws", region="us-east-1", zone="us-east-1a", instance_type="g5.xlarge",
                       gpu_type="A10G", gpu_count=1, gpu_memory_gb=24, market=Market.spot, usd_per_hour=0.5,
                       carbon_zone="US-MIDA-PJM")
    calls = []
    chosen, _, history = run([offer], {"aws": FakeCompute("aws", {}, calls)}, calls)
    assert chosen is offer
    assert OfferOption.of(offer).offer_id == offer.offer_id == A
    assert summary(history) == [(A, None)]


def test_quota_scope_uses_the_adapters_family_when_it_has_one():
    from providers.aws import AwsCompute

    aws = AwsCompute(region_clients=lambda r: None)
    assert quota_scope(opt("us-east-1a", "g5.xlarge"), aws) == ("aws", "us-east-1", "spot", "G")
    assert quota_scope(opt("us-east-1a", "g6e.xlarge"), aws) == ("aws", "us-east-1", "spot", "G")
    assert quota_scope(opt("us-east-1a", "p5.48xlarge", gpu="H100"), aws) == ("aws", "us-east-1", "spot", "P")
    assert quota_scope(opt("us-east-1a", "g5.xlarge"), None) == ("aws", "us-east-1", "spot", "A10G")
