"""The settings know the cloud providers by the registry (providers.registry.PROVIDERS), named once."""

from __future__ import annotations

import dataclasses

import pytest

import providers.registry as registry
from broker.service.settings import SettingsError, load_settings


def test_a_provider_added_to_the_registry_is_one_the_settings_accept_and_name(monkeypatch):
    # a third provider configured by the gcp section (what its registry line names), to see the names come from there
    monkeypatch.setitem(registry.PROVIDERS, "oci", dataclasses.replace(registry.PROVIDERS["gcp"], name="oci"))
    with pytest.raises(SettingsError) as e:
        load_settings(cloud_providers=["azure"])
    assert str(e.value) == "setting cloud_providers: 'azure' is not a known provider (aws, gcp, oci)"
    with pytest.raises(SettingsError) as e:
        load_settings(cloud_providers=["oci"])
    assert str(e.value).startswith("settings: cloud_providers lists 'oci' but the 'gcp' section is missing")
