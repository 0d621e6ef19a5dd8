"""providers.registry: one line per provider; every reference resolves; adapters are built through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from providers.registry import PROVIDERS, build_adapters, entry, offer_allowed


def test_every_provider_line_names_callables_that_resolve():
    assert sorted(PROVIDERS) == ["aws", "gcp"]
    for name, e in PROVIDERS.items():
        assert e.name == e.settings_section == name
        for what in ("adapter", "offers", "allows", "terraform"):
            assert callable(e.load(what)), (name, what)
    with pytest.raises(ValueError, match="provider='azure': must be one of aws, gcp"):
        entry("azure")


def test_a_gcp_adapter_for_an_endpoint_is_made_by_for_endpoint_with_anonymous_credentials():
    from google.auth.credentials import AnonymousCredentials

    gcp = SimpleNamespace(project="p1", gpu_image="img", network="global/networks/n", subnetwork=None,
                          service_account_email=None, operation_timeout_s=30.0, api_endpoint="http://127.0.0.1:9")
    [(name, compute)] = build_adapters(["gcp"], {"gcp": gcp}.__getitem__).items()
    assert name == "gcp" and compute.project == "p1" and compute.image == "img"
    assert compute._client_options == {"api_endpoint": "http://127.0.0.1:9"}
    assert isinstance(compute._credentials, AnonymousCredentials)


def test_offer_allowed_asks_the_providers_own_network_check():
    sections = {"gcp": SimpleNamespace(region="europe-west4"),
                "aws": SimpleNamespace(regions={"us-east-1": SimpleNamespace(subnet_ids_by_az={"us-east-1a": "s"},
                                                                            subnet_ids_by_az_id={"use1-az6": "s"})})}
    o = lambda p, r, z: SimpleNamespace(provider=p, region=r, zone=z)  # noqa: E731
    allowed = lambda names, offer: offer_allowed(names, sections.__getitem__, offer)  # noqa: E731
    assert allowed(["gcp"], o("gcp", "europe-west4", "europe-west4-a"))
    assert not allowed(["gcp"], o("gcp", "us-central1", "us-central1-a"))
    assert not allowed(["aws"], o("gcp", "europe-west4", "europe-west4-a"))  # not configured
    assert allowed(["aws"], o("aws", "us-east-1", "use1-az6")) and allowed(["aws"], o("aws", "us-east-1", "us-east-1a"))
    assert not allowed(["aws"], o("aws", "us-east-1", "us-east-1b"))
    assert not allowed(["aws", "azure"], o("azure", "eastus", "eastus-1"))
