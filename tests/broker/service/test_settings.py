"""broker.service.settings: the YAML file (duplicate keys), AWS region and zone names, unreadable files."""

from __future__ import annotations

import pytest

from broker.service.settings import SettingsError, load_settings

AMI = "ami-0123456789abcdef0"

EAST = """\
cloud_providers:
- aws
aws:
  regions:
    us-east-1:
      ami_id: ami-0123456789abcdef0
      subnet_ids_by_az:
        us-east-1a: subnet-0aa
"""
GCP = """\
cloud_providers:
- gcp
gcp:
  project: ml-burst-123
  region: us-central1
"""


def _aws(region: str = "us-east-1", **section) -> dict:
    return {"regions": {region: {"ami_id": AMI, "subnet_ids_by_az": {f"{region}a": "subnet-0aa"}, **section}}}


def test_two_pasted_outputs_with_the_same_top_level_key_are_an_error(tmp_path):
    # the AWS section, then the GCP one pasted under it: the second cloud_providers silently dropped AWS
    f = tmp_path / "x.yaml"
    f.write_text(EAST + GCP)
    with pytest.raises(SettingsError) as e:
        load_settings(f)
    assert str(e.value) == f"FEDBROKER_CONFIG={str(f)!r}: key 'cloud_providers' appears twice (lines 1 and 9)"


def test_a_duplicate_nested_key_names_the_mapping_it_is_in(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text(EAST + "    us-east-1:\n      ami_id: ami-0123456789abcdef1\n")
    with pytest.raises(SettingsError) as e:
        load_settings(f)
    assert str(e.value) == (f"FEDBROKER_CONFIG={str(f)!r}: key 'us-east-1' under 'aws.regions' appears twice "
                            "(lines 5 and 9)")


def test_the_file_otherwise_loads_as_before(tmp_path):
    f = tmp_path / "x.yaml"
    # a merge key may be overridden (that is what it is for); the same key in two mappings is fine
    f.write_text(EAST + "cloud:\n  <<: {poll_interval_s: 10, sweep_interval_s: 20}\n  poll_interval_s: 5\n"
                 "planner: {}\n")
    st = load_settings(f)
    assert st.cloud_providers == ("aws",)
    assert st.aws.regions["us-east-1"].subnet_ids_by_az == {"us-east-1a": "subnet-0aa"}
    assert (st.cloud.poll_interval_s, st.cloud.sweep_interval_s) == (5, 20)
    f.write_text("- a list\n")
    with pytest.raises(SettingsError, match="must hold a mapping of settings, got list"):
        load_settings(f)
    f.write_text("api_port: [1\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(f)


def test_a_file_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SettingsError) as e:
        load_settings(missing)
    assert str(e.value) == f"FEDBROKER_CONFIG={str(missing)!r}: cannot read (No such file or directory)"


def test_a_mistyped_region_is_an_error_with_the_closest_region():
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws("us-eest-1"))
    assert str(e.value) == "setting aws.regions: 'us-eest-1' is not an AWS region (did you mean 'us-east-1'?)"
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws("moon"))
    assert str(e.value).startswith("setting aws.regions: 'moon' is not an AWS region (botocore ")
    assert str(e.value).endswith("regions; a region newer than it needs a newer boto3)")


def test_regions_of_every_partition_are_known():
    regions = ("eu-west-1", "us-gov-west-1", "cn-north-1")
    st = load_settings(aws={"regions": {r: _aws(r)["regions"][r] for r in regions}})
    assert sorted(st.aws.regions) == ["cn-north-1", "eu-west-1", "us-gov-west-1"]


def test_subnet_zones_must_be_zones_of_their_region():
    bad = {"us-east-1a": "subnet-0aa", "us-west-2a": "subnet-0bb"}
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws(subnet_ids_by_az=bad))
    assert str(e.value) == ("setting aws.regions.us-east-1.subnet_ids_by_az: 'us-west-2a' is not a zone of us-east-1 "
                            "(zone names are the region and a letter, e.g. us-east-1a, or a Local Zone such as "
                            "us-east-1-xyz-1a)")
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws(subnet_ids_by_az={"use1-az1": "subnet-0aa"}))
    assert str(e.value) == ("setting aws.regions.us-east-1.subnet_ids_by_az: 'use1-az1' is not a zone of us-east-1 "
                            "(that is an AZ ID: put it under subnet_ids_by_az_id)")
    with pytest.raises(SettingsError) as e:  # a zone of a region whose name the other starts with
        load_settings(aws=_aws("us-east-1", subnet_ids_by_az={"us-east-11a": "subnet-0aa"}))
    assert "'us-east-11a' is not a zone of us-east-1" in str(e.value)
    ok = load_settings(aws=_aws("us-west-2",
                                subnet_ids_by_az={"us-west-2b": "subnet-0aa", "us-west-2-lax-1a": "subnet-0bb"},
                                subnet_ids_by_az_id={"usw2-az2": "subnet-0aa", "usw2-lax1-az1": "subnet-0bb"}))
    assert sorted(ok.aws.regions["us-west-2"].subnet_ids_by_az) == ["us-west-2-lax-1a", "us-west-2b"]


def test_subnet_az_id_keys_must_be_az_ids():
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws(subnet_ids_by_az_id={"us-east-1a": "subnet-0aa"}))
    assert str(e.value) == ("setting aws.regions.us-east-1.subnet_ids_by_az_id: 'us-east-1a' is not an AZ ID "
                            "(that is a zone name: put it under subnet_ids_by_az)")
    with pytest.raises(SettingsError) as e:
        load_settings(aws=_aws(subnet_ids_by_az_id={"az1": "subnet-0aa"}))
    assert str(e.value) == ("setting aws.regions.us-east-1.subnet_ids_by_az_id: 'az1' is not an AZ ID "
                            "(AZ IDs look like use1-az1 or usw2-lax1-az1)")


def test_other_messages_keep_their_shape():
    with pytest.raises(SettingsError) as e:
        load_settings(api_port=0)
    assert str(e.value) == "setting api_port=0: Input should be greater than or equal to 1"
    with pytest.raises(SettingsError) as e:
        load_settings(cloud_providers=["azure"])
    assert str(e.value) == "setting cloud_providers: 'azure' is not a known provider (aws, gcp)"
    with pytest.raises(SettingsError) as e:
        load_settings(cloud_providers=["aws"])
    assert str(e.value).startswith("settings: cloud_providers lists 'aws' but the 'aws' section is missing")


def test_az_ids_must_be_of_their_region():
    from broker.service.settings import SettingsError, az_id_prefix, load_settings

    assert [az_id_prefix(r) for r in ("us-east-1", "ap-northeast-1", "us-gov-west-1", "eu-central-2")] == [
        "use1", "apne1", "usgw1", "euc2"]
    region = {"ami_id": "ami-0123456789abcdef0", "subnet_ids_by_az": {"us-east-1a": "subnet-1"},
              "subnet_ids_by_az_id": {"usw2-az1": "subnet-2"}}
    with pytest.raises(SettingsError) as e:
        load_settings(aws={"regions": {"us-east-1": region}})
    assert "'usw2-az1' is not an AZ ID of us-east-1 (they start with use1-, e.g. use1-az1)" in str(e.value)


def test_a_list_setting_from_the_environment_needs_json(monkeypatch):
    from broker.service.settings import SettingsError, load_settings

    monkeypatch.setenv("FEDBROKER_CLOUD_PROVIDERS", "aws")
    with pytest.raises(SettingsError) as e:
        load_settings()
    assert str(e.value).endswith("a list or mapping setting takes JSON in the environment, "
                                 """e.g. FEDBROKER_CLOUD_PROVIDERS='["aws"]'""")


def test_yaml_aliases_that_expand_beyond_the_limit_are_refused_fast():
    import yaml

    from broker.service.settings import load_yaml

    levels = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefg", "bcdefgh"):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    with pytest.raises(yaml.YAMLError, match=r"expands to more than 100000 values through its aliases"):
        load_yaml("\n".join(levels) + "\ncommand: *h\n")  # refused before it is expanded (it took minutes)
    # a few aliases are fine: 9 + 81 + 1 values
    assert len(load_yaml("\n".join(levels[:2]) + "\nx: *b\n")["x"]) == 9


@pytest.mark.parametrize("text, line", [
    ("signals: {sources: {electricitymaps: {api_key: SUPERSECRETKEY123}}}",
     "setting signals.sources.electricitymaps.api_key=<hidden>: Extra inputs are not permitted"),
    ("signals: {electricitymaps_api_key: SUPERSECRETKEY123}",
     "setting signals.electricitymaps_api_key=<hidden>: Extra inputs are not permitted"),
    # a whole section of the wrong type: the key under it is hidden in the echoed mapping
    ("signals: {sources: {electricitymaps: [{api_key: SUPERSECRETKEY123}]}}",
     "setting signals.sources.electricitymaps=[{'api_key': '<hidden>'}]: "
     "Input should be a valid dictionary or instance of SourceSettings"),
])
def test_a_secret_in_a_bad_setting_is_never_echoed(tmp_path, text, line):
    # a new user's report: the API key written in the settings file came back on stderr
    p = tmp_path / "broker.yaml"
    p.write_text(text + "\n")
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    assert str(e.value) == line
    assert "SUPERSECRETKEY123" not in str(e.value)


def test_a_url_password_in_a_bad_setting_is_masked(tmp_path):
    p = tmp_path / "broker.yaml"
    p.write_text('cloud: {report_url: "ftp://user:pa55w0rd@[::1"}\n')
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    assert "pa55w0rd" not in str(e.value)
    assert str(e.value).startswith("setting cloud.report_url='ftp://user:***@[::1': "), str(e.value)


def test_api_max_connections_per_peer_default_and_bounds(tmp_path, monkeypatch):
    assert load_settings(state_dir=tmp_path).api_max_connections_per_peer == 64
    assert load_settings(state_dir=tmp_path, api_max_connections_per_peer=0).api_max_connections_per_peer == 0
    # the default under a smaller process cap is lowered to it; a value given above it is an error naming both
    assert load_settings(state_dir=tmp_path, api_max_connections=20).api_max_connections_per_peer == 20
    assert load_settings(state_dir=tmp_path, api_max_connections=20,
                         api_max_connections_per_peer=20).api_max_connections_per_peer == 20
    with pytest.raises(SettingsError) as e:
        load_settings(state_dir=tmp_path, api_max_connections=20, api_max_connections_per_peer=21)
    assert str(e.value) == ("settings: api_max_connections_per_peer=21 is above api_max_connections=20: a per-address "
                            "cap must be at most the cap of the whole process (0 = no per-address cap)")
    with pytest.raises(SettingsError) as e:
        load_settings(state_dir=tmp_path, api_max_connections_per_peer=-1)
    assert str(e.value) == "setting api_max_connections_per_peer=-1: Input should be greater than or equal to 0"
    monkeypatch.setenv("FEDBROKER_API_MAX_CONNECTIONS_PER_PEER", "8")
    assert load_settings(state_dir=tmp_path).api_max_connections_per_peer == 8
