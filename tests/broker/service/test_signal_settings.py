"""The ``signals:`` settings section: chains per zone, keys from the environment or a secrets file, errors."""

from __future__ import annotations

import pytest

from broker.service.settings import SettingsError, load_settings


def _load(tmp_path, text: str):
    f = tmp_path / "fedbroker.yaml"
    f.write_text(text)
    return load_settings(f)


def test_no_section_is_the_bundled_replay(tmp_path):
    st = _load(tmp_path, "redis_url: redis://127.0.0.1:6379/13\n")
    assert not st.signals.enabled
    assert st.signals.chain("DE", "carbon") == ["bundled"]
    assert st.signals.refresh_for("DE") == 900.0 and st.signals.stale_for("DE") == 10800.0


def test_chains_ids_and_overrides(tmp_path):
    st = _load(tmp_path, """
signals:
  refresh_s: 600
  tariffs:
    CA-ON: {timezone: America/Toronto, currency: CAD, per: kWh, default: 0.1}
  zones:
    DE-LU: {carbon: [electricitymaps, bundled], price: [entsoe-day-ahead, bundled], ids: {electricitymaps: DE},
            stale_after_s: 7200}
    CA-ON: {price: [tariff], refresh_s: 3600}
""")
    sg = st.signals
    assert sg.enabled
    assert sg.chain("DE-LU", "carbon") == ["electricitymaps", "bundled"]
    assert sg.chain("CA-ON", "carbon") == ["bundled"] and sg.chain("CA-ON", "price") == ["tariff"]
    assert sg.chain("FR", "price") == ["bundled"]
    assert sg.source_zone("DE-LU", "electricitymaps") == "DE" and sg.source_zone("DE-LU", "entsoe-day-ahead") == "DE-LU"
    assert (sg.refresh_for("DE-LU"), sg.refresh_for("CA-ON")) == (600.0, 3600.0)
    assert (sg.stale_for("DE-LU"), sg.stale_for("CA-ON")) == (7200.0, 10800.0)


@pytest.mark.parametrize("body, msg", [
    ("zones: {DE: {carbon: [electricitymap]}}",
     "setting signals.zones.DE.carbon: 'electricitymap' is not a carbon source (choose from electricitymaps, bundled)"),
    ("zones: {DE: {price: [electricitymaps]}}",
     "setting signals.zones.DE.price: 'electricitymaps' is not a price source "
     "(choose from entsoe-day-ahead, tariff, bundled)"),
    ("zones: {DE: {carbon: [bundled, electricitymaps]}}",
     "setting signals.zones.DE.carbon=['bundled', 'electricitymaps']: 'bundled' must come last "
     "(it always has a value, so sources after it are never asked)"),
    ("zones: {DE: {carbon: [electricitymaps, electricitymaps]}}",
     "setting signals.zones.DE.carbon=['electricitymaps', 'electricitymaps']: lists a source twice"),
    ("zones: {DE: {carbon: []}}", "setting signals.zones.DE.carbon: empty; list at least one source (e.g. [bundled])"),
    ("zones: {GB: {carbon: [gb-carbon-intensity]}}",
     "setting signals.zones.GB.carbon: 'gb-carbon-intensity' publishes operational gCO2/kWh; the planner weighs "
     "life-cycle gCO2e/kWh (use electricitymaps for GB)"),
    ("zones: {US-CAL-CISO: {carbon: [watttime, bundled], ids: {watttime: CAISO_NORTH}}}",
     "setting signals.zones.US-CAL-CISO.carbon: 'watttime' publishes a marginal emission rate (MOER, gCO2/kWh); the "
     "planner weighs average life-cycle gCO2e/kWh in every zone and fallback, and ranks zones against each other, "
     "so a marginal zone cannot be mixed in (use electricitymaps; README, Live signals)"),
    ("sources: {watttime: {timeout_s: 5}}",
     "setting signals.sources.watttime: 'watttime' publishes a marginal emission rate (MOER, gCO2/kWh); the "
     "planner weighs average life-cycle gCO2e/kWh in every zone and fallback, and ranks zones against each other, "
     "so a marginal zone cannot be mixed in (use electricitymaps; README, Live signals)"),
    ("zones: {US-CAL-CISO: {carbon: [watttime], carbon_signal: marginal}}",  # no per-zone opt-in (module docstring)
     "setting signals.zones.US-CAL-CISO.carbon_signal='marginal': Extra inputs are not permitted"),
    ("zones: {CA-ON: {price: [tariff]}}", "setting signals.zones.CA-ON.price: 'tariff' needs tariffs.CA-ON "
     "(the zone's tariff)"),
    ("tariffs: {CA-ON: {timezone: America/Nowhere, currency: CAD, default: 0.1}}",
     "setting signals.tariffs.CA-ON.timezone='America/Nowhere': not an IANA time zone"),
    ("sources: {bundled: {burst: 3}}",
     "setting signals.sources.bundled: not a network source (choose from electricitymaps, entsoe-day-ahead, tariff, "
     "aws-spot-history, aws-price-list, gcp-billing-catalog)"),
    ("cloud_prices: {aws: [US East 1]}",
     "setting signals.cloud_prices.aws: region 'US East 1': not a region id such as us-east-1 or us-central1"),
    ("cloud_prices: {gcp: [us-central1, us-central1]}",
     "setting signals.cloud_prices.gcp=['us-central1', 'us-central1']: lists a region twice"),
    ("zones: {DE: {price: [aws-price-list]}}",
     "setting signals.zones.DE.price: 'aws-price-list' is not a price source (choose from entsoe-day-ahead, tariff, "
     "bundled)"),
    ("zones: {DE: {carbon: [electricitymaps], ids: {entsoe-day-ahead: DE_LU}}}",
     "setting signals.zones.DE.ids.entsoe-day-ahead: the zone does not use that source"),
    ("refresh_s: 10", "setting signals.refresh_s=10: Input should be greater than or equal to 60"),
])
def test_bad_values_name_the_field_and_value(tmp_path, body, msg):
    with pytest.raises(SettingsError) as e:
        _load(tmp_path, "signals:\n  " + body + "\n")
    assert str(e.value) == msg


def test_keys_from_environment_then_secrets_file_never_in_the_settings(tmp_path, monkeypatch):
    secrets = tmp_path / "keys.yaml"
    secrets.write_text("electricitymaps: file-key-123\n")
    monkeypatch.delenv("ELECTRICITYMAPS_API_KEY", raising=False)
    st = _load(tmp_path, f"signals:\n  secrets_file: {secrets}\n  zones: {{DE: {{carbon: [electricitymaps]}}}}\n")
    assert st.signals.api_key("electricitymaps") == "file-key-123"
    assert st.signals.api_key("entsoe-day-ahead") is None
    assert "file-key-123" not in st.model_dump_json()
    monkeypatch.setenv("ELECTRICITYMAPS_API_KEY", "env-key-456")
    assert st.signals.api_key("electricitymaps") == "env-key-456"
    assert st.signals.key_hint("electricitymaps") == f"$ELECTRICITYMAPS_API_KEY or {secrets}:electricitymaps"


def _secrets_refused(tmp_path, text: str):
    """The path of a secrets file holding ``text``, and the message of the settings naming it refused."""
    secrets = tmp_path / "keys.yaml"
    secrets.write_text(text)
    with pytest.raises(SettingsError) as e:
        _load(tmp_path, f"signals:\n  secrets_file: {secrets}\n")
    return secrets, str(e.value)


def test_a_bad_secrets_file_is_named_but_never_quoted(tmp_path):
    secrets, msg = _secrets_refused(tmp_path, "electricitymap: sk-very-secret\n")
    assert msg == (f"setting signals.secrets_file={str(secrets)!r}: 'electricitymap' is not a source with "
                   "a key (electricitymaps, entsoe-day-ahead)")
    assert "sk-very-secret" not in msg


def test_a_secrets_file_with_a_key_twice_is_refused_naming_file_key_and_lines(tmp_path, monkeypatch):
    """Like every other config file (the last one silently won before); never quoting a value."""
    secrets, msg = _secrets_refused(tmp_path, "electricitymaps: sk-first\nentsoe-day-ahead: e-key\n"
                                              "electricitymaps: sk-second\n")
    assert msg == f"setting signals.secrets_file={str(secrets)!r}: key 'electricitymaps' appears twice (lines 1 and 3)"
    assert "sk-" not in msg and "e-key" not in msg
    # and when the file changes under a running broker: the key is looked up again, and refused the same way
    secrets.write_text("electricitymaps: sk-first\n")
    st = _load(tmp_path, f"signals:\n  secrets_file: {secrets}\n")
    secrets.write_text("electricitymaps: sk-first\nelectricitymaps: sk-second\n")
    monkeypatch.delenv("ELECTRICITYMAPS_API_KEY", raising=False)
    with pytest.raises(ValueError) as e:
        st.signals.api_key("electricitymaps")
    assert str(e.value) == f"secrets_file={str(secrets)!r}: key 'electricitymaps' appears twice (lines 1 and 2)"


def test_beat_refreshes_signals_only_when_a_zone_is_configured(tmp_path):
    from broker.service.celery_app import SIGNALS_TICK_S, make_celery

    off = make_celery(_load(tmp_path, "redis_url: redis://127.0.0.1:6379/13\n"))
    assert "signals" not in off.conf.beat_schedule
    on = make_celery(_load(tmp_path, "signals:\n  zones: {DE-LU: {carbon: [electricitymaps, bundled]}}\n"))
    assert on.conf.beat_schedule["signals"]["task"] == "fedbroker.signals_refresh"
    assert on.conf.beat_schedule["signals"]["schedule"] == SIGNALS_TICK_S == 60.0
    assert on.conf.task_routes["fedbroker.signals_refresh"] == {"queue": "provisioning"}
