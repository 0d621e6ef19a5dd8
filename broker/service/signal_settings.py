"""The ``signals:`` settings section: which live sources serve each zone's carbon intensity and electricity price.

With no ``signals:`` section (or no ``zones`` in it) the live broker replays the bundled 2023-2024 history as
before (:class:`broker.service.live.ReplayedSignals`). With one, each zone listed gets its sources in order of
preference; zones not listed keep the bundled replay::

    signals:
      refresh_s: 900              # seconds between fetches of a zone's sources (beat; one fetch per period)
      stale_after_s: 10800        # a source's values older than this are "last known", not fresh
      history_h: 24               # measured hours fetched back from now
      forecast_h: 72              # forecast hours asked for ahead of now
      secrets_file: /etc/fedbroker/signal-keys.yaml   # optional {source: key}; the environment wins
      sources:                    # optional per-source options (defaults below)
        electricitymaps: {requests_per_s: 0.5, burst: 5}
      tariffs:                    # an operator's tariff per price zone (pricing.price_sources.Tariff config)
        CA-ON: {timezone: America/Toronto, currency: CAD, per: kWh, default: 0.098}
      zones:
        DE:      {carbon: [electricitymaps, bundled], price: [entsoe-day-ahead, bundled], ids: {entsoe-day-ahead: DE_LU}}
        CA-ON:   {carbon: [electricitymaps, bundled], price: [tariff], refresh_s: 3600}

**Cloud prices** (optional ``cloud_prices``): live $/h of the bundled cloud offers in the regions listed, from
AWS spot price history and the AWS Price List (``aws``) and the GCP Cloud Billing Catalog (``gcp``)
(:mod:`pricing.cloud_price_sources`); offers elsewhere, and any offer no live price is known for, keep the bundled
catalog price. Credentials come from the normal boto3 / ``google.auth`` chains, not from this file::

    signals:
      cloud_prices:
        aws: [us-east-1, us-west-2]   # regions: spot history (ec2:DescribeSpotPriceHistory) + on-demand (pricing:GetProducts)
        gcp: [us-central1]            # regions: Cloud Billing Catalog (read access to the public catalog)
        refresh_s: 3600               # seconds between fetches per provider (one fetch per period, all processes)
        stale_after_s: 21600          # a price fetched longer ago than this is "last known", not fresh
        spot_history_h: 6             # hours of spot price history fetched back from now

Source names (:data:`SOURCE_KINDS`): ``electricitymaps`` (carbon, key ``ELECTRICITYMAPS_API_KEY``),
``entsoe-day-ahead`` (price, key ``ENTSOE_API_KEY``), ``tariff`` (price, from ``tariffs``), ``bundled`` (both:
the 2023-24 history replayed by whole weeks; it is the planner's last resort whether listed or not, and if
listed it must come last). Two carbon readers of :mod:`pricing.carbon_sources` are refused in a chain
(:data:`REFUSED_CARBON`, an error naming the field): the GB Carbon Intensity API publishes operational
gCO2/kWh, and the planner weighs life-cycle gCO2e/kWh (mixing them would make GB look ~10-20 % greener than its
neighbours); WattTime publishes a *marginal* rate (MOER), and every planner series is an *average* intensity.
Refused rather than allowed per zone behind a ``carbon_signal: marginal`` switch, because the planner compares
zones with each other and fills a zone's gaps from average series (the bundled replay, the ``blend`` forecast of
cached hours, the conservative 95th percentile): a marginal zone would be ranked against average neighbours
and spliced with average hours, on a scale that differs by a factor of ~2 on many grids. Accepting it needs a
planner that weighs marginal rates in every zone and fallback, which this broker does not have.

API keys come from the environment variable (``sources.<name>.api_key_env``, default the source's own) or
else from ``secrets_file`` (a YAML mapping ``source name -> key``, each source once); they are never part of the
settings object, never logged and never put in an error or an explain record. Errors name the field and value
(:class:`ValueError`, turned into :class:`broker.service.settings.SettingsError` by ``load_settings``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.unique_keys import DuplicateKeyError, read_document
from pricing.carbon_sources import ELECTRICITYMAPS_KEY_ENV, GbCarbonIntensity, WattTime
from pricing.cloud_price_sources import AWS_PRICE_LIST, AWS_SPOT, GCP_BILLING_CATALOG
from pricing.price_sources import ENTSOE_KEY_ENV, Tariff, TariffError

__all__ = ["SignalsSettings", "ZoneSignals", "SourceSettings", "CloudPriceSettings", "SOURCE_KINDS", "KEY_ENVS",
           "BUNDLED", "CLOUD_SOURCES", "REFUSED_CARBON"]

#: the bundled 2023-24 history replayed by whole weeks (always the last resort)
BUNDLED = "bundled"
#: source name -> the signal kinds it serves ("carbon": life-cycle gCO2e/kWh, "price": USD/MWh)
SOURCE_KINDS: dict[str, tuple[str, ...]] = {"electricitymaps": ("carbon",), "entsoe-day-ahead": ("price",),
                                            "tariff": ("price",), BUNDLED: ("carbon", "price"),
                                            AWS_SPOT: ("cloud",), AWS_PRICE_LIST: ("cloud",),
                                            GCP_BILLING_CATALOG: ("cloud",)}
#: provider -> the live cloud price sources asked for its offers (``cloud_prices``)
CLOUD_SOURCES: dict[str, tuple[str, ...]] = {"aws": (AWS_SPOT, AWS_PRICE_LIST), "gcp": (GCP_BILLING_CATALOG,)}
#: source name -> default environment variable of its API key (sources that need one)
KEY_ENVS: dict[str, str] = {"electricitymaps": ELECTRICITYMAPS_KEY_ENV, "entsoe-day-ahead": ENTSOE_KEY_ENV}
#: carbon sources of :mod:`pricing.carbon_sources` the planner must not weigh -> why (the error's text)
REFUSED_CARBON: dict[str, str] = {
    GbCarbonIntensity.name: f"publishes operational {GbCarbonIntensity.unit}; the planner weighs life-cycle "
                            "gCO2e/kWh (use electricitymaps for GB)",
    WattTime.name: f"publishes a {WattTime.signal} emission rate (MOER, {WattTime.unit}); the planner weighs average "
                   "life-cycle gCO2e/kWh in every zone and fallback, and ranks zones against each other, so a marginal "
                   "zone cannot be mixed in (use electricitymaps; README, Live signals)",
}


class SourceSettings(BaseModel):
    """Options of one network source (``signals.sources.<name>``).

    Fields (units):
        api_key_env: environment variable holding the key (default: :data:`KEY_ENVS`).
        base_url: API root (``None``: the source's public endpoint).
        requests_per_s: sustained requests per second, all processes together (token bucket in Redis).
        burst: bucket size, requests.
        max_retries: retries of one request after a 429, a 5xx or a 401 that follows a success.
        backoff_s: wait before the first retry of a 5xx, seconds; doubles each retry (capped at max_backoff_s).
        max_backoff_s: longest wait a fetch sleeps; a longer ``Retry-After`` makes the source skip its refreshes
            until then instead (the zone decides on last-known values meanwhile).
        timeout_s: per-request timeout, seconds.
    """

    model_config = ConfigDict(extra="forbid")

    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    base_url: str | None = Field(None, pattern=r"^https?://")
    requests_per_s: float = Field(0.5, gt=0, le=1000)
    burst: int = Field(5, ge=1, le=10_000)
    max_retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(2.0, gt=0, le=3600)
    max_backoff_s: float = Field(30.0, gt=0, le=3600)
    timeout_s: float = Field(10.0, gt=0, le=120)


class ZoneSignals(BaseModel):
    """One zone's sources (``signals.zones.<zone>``): ``carbon`` and ``price`` lists in order of preference,
    ``ids`` (source -> that source's id of the zone, e.g. ``{entsoe-day-ahead: DE_LU}``; default the zone id),
    and overrides of the section's ``refresh_s`` / ``stale_after_s`` (seconds)."""

    model_config = ConfigDict(extra="forbid")

    carbon: list[str] = Field(default_factory=lambda: [BUNDLED])
    price: list[str] = Field(default_factory=lambda: [BUNDLED])
    ids: dict[str, str] = Field(default_factory=dict)
    refresh_s: float | None = Field(None, ge=60, le=7 * 86400)
    stale_after_s: float | None = Field(None, gt=0, le=30 * 86400)


class CloudPriceSettings(BaseModel):
    """``signals.cloud_prices`` (module docstring): ``aws`` and ``gcp`` (region lists), ``refresh_s`` and
    ``stale_after_s`` (seconds), ``spot_history_h`` (hours)."""

    model_config = ConfigDict(extra="forbid")

    aws: list[str] = Field(default_factory=list)
    gcp: list[str] = Field(default_factory=list)
    refresh_s: float = Field(3600.0, ge=300, le=7 * 86400)
    stale_after_s: float = Field(6 * 3600.0, gt=0, le=30 * 86400)
    spot_history_h: int = Field(6, ge=1, le=24 * 7)

    def regions(self, provider: str) -> list[str]:
        """The regions of ``provider`` (``aws``/``gcp``) whose offers get live prices."""
        return list(getattr(self, provider))

    @property
    def providers(self) -> list[str]:
        """Providers with at least one region listed."""
        return [p for p in CLOUD_SOURCES if getattr(self, p)]


class SignalsSettings(BaseModel):
    """The ``signals:`` section (see the module docstring). Fields (units): ``zones``, ``sources``, ``tariffs``,
    ``cloud_prices``,
    ``secrets_file``, ``refresh_s`` (seconds, >= 60), ``stale_after_s`` (seconds), ``history_h`` and
    ``forecast_h`` (hours)."""

    model_config = ConfigDict(extra="forbid")

    zones: dict[str, ZoneSignals] = Field(default_factory=dict)
    sources: dict[str, SourceSettings] = Field(default_factory=dict)
    tariffs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    cloud_prices: CloudPriceSettings = Field(default_factory=CloudPriceSettings)
    secrets_file: Path | None = None
    refresh_s: float = Field(900.0, ge=60, le=7 * 86400)
    stale_after_s: float = Field(3 * 3600.0, gt=0, le=30 * 86400)
    history_h: int = Field(24, ge=1, le=24 * 14)
    forecast_h: int = Field(72, ge=1, le=24 * 14)

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, v: dict[str, SourceSettings]) -> dict[str, SourceSettings]:
        for name in v:
            if name in REFUSED_CARBON:
                raise ValueError(f"sources.{name}: {name!r} {REFUSED_CARBON[name]}")
            if name not in SOURCE_KINDS or name == BUNDLED:
                raise ValueError(f"sources.{name}: not a network source (choose from "
                                 f"{', '.join(n for n in SOURCE_KINDS if n != BUNDLED)})")
        return v

    @field_validator("secrets_file")
    @classmethod
    def _secrets_readable(cls, v: Path | None) -> Path | None:
        if v is not None:
            _read_secrets(v)  # raises naming the file (never a key)
        return v

    @model_validator(mode="after")
    def _chains(self) -> "SignalsSettings":
        for provider in CLOUD_SOURCES:
            regions = self.cloud_prices.regions(provider)
            for r in regions:
                if not re.fullmatch(r"[a-z]+(-[a-z0-9]+)+", r):
                    raise ValueError(f"cloud_prices.{provider}: region {r!r}: not a region id such as us-east-1 or "
                                     "us-central1")
            if len(set(regions)) != len(regions):
                raise ValueError(f"cloud_prices.{provider}={regions!r}: lists a region twice")
        for zone, t in self.tariffs.items():
            try:
                Tariff({"zone": zone, **t})
            except TariffError as e:
                msg = str(e).removeprefix("tariff")
                raise ValueError(f"tariffs.{zone}{msg if msg[:1] in '.:' else ': ' + msg}") from None
        for zone, z in self.zones.items():
            for kind in ("carbon", "price"):
                chain = getattr(z, kind)
                field = f"zones.{zone}.{kind}"
                if not chain:
                    raise ValueError(f"{field}: empty; list at least one source (e.g. [{BUNDLED}])")
                if len(set(chain)) != len(chain):
                    raise ValueError(f"{field}={chain!r}: lists a source twice")
                for name in chain:
                    if name in REFUSED_CARBON:
                        raise ValueError(f"{field}: {name!r} {REFUSED_CARBON[name]}")
                    if kind not in SOURCE_KINDS.get(name, ()):
                        ok = [n for n, k in SOURCE_KINDS.items() if kind in k]
                        raise ValueError(f"{field}: {name!r} is not a {kind} source (choose from {', '.join(ok)})")
                    if name == "tariff" and zone not in self.tariffs:
                        raise ValueError(f"{field}: 'tariff' needs tariffs.{zone} (the zone's tariff)")
                if BUNDLED in chain[:-1]:
                    raise ValueError(f"{field}={chain!r}: {BUNDLED!r} must come last (it always has a value, "
                                     "so sources after it are never asked)")
            for src in z.ids:
                if src not in z.carbon and src not in z.price:
                    raise ValueError(f"zones.{zone}.ids.{src}: the zone does not use that source")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def enabled(self) -> bool:
        """Whether any zone has sources configured (else: the bundled replay everywhere)."""
        return bool(self.zones)

    @property
    def cloud_enabled(self) -> bool:
        """Whether ``cloud_prices`` lists a region (else every offer keeps its bundled catalog price)."""
        return bool(self.cloud_prices.providers)

    def source(self, name: str) -> SourceSettings:
        """The options of source ``name`` (defaults if the section does not list it)."""
        return self.sources.get(name) or SourceSettings()

    def refresh_for(self, zone: str) -> float:
        """Seconds between fetches of ``zone``'s sources."""
        z = self.zones.get(zone)
        return z.refresh_s if z is not None and z.refresh_s is not None else self.refresh_s

    def stale_for(self, zone: str) -> float:
        """Seconds after which ``zone``'s fetched values count as last-known rather than fresh."""
        z = self.zones.get(zone)
        return z.stale_after_s if z is not None and z.stale_after_s is not None else self.stale_after_s

    def chain(self, zone: str, kind: str) -> list[str]:
        """The sources of ``zone``'s ``kind`` (``"carbon"``/``"price"``) in order; ``[bundled]`` for a zone not listed."""
        z = self.zones.get(zone)
        return list(getattr(z, kind)) if z is not None else [BUNDLED]

    def source_zone(self, zone: str, source: str) -> str:
        """``source``'s id of ``zone`` (``ids`` or the zone id itself)."""
        z = self.zones.get(zone)
        return z.ids.get(source, zone) if z is not None else zone

    def api_key(self, source: str) -> str | None:
        """The API key of ``source``: its environment variable, else ``secrets_file``; ``None`` when neither has it.

        Never logged; raises ``ValueError`` naming the file (not its contents) if ``secrets_file`` became unreadable."""
        env = self.source(source).api_key_env or KEY_ENVS.get(source)
        if env and os.environ.get(env):
            return os.environ[env]
        if self.secrets_file is not None:
            key = _read_secrets(self.secrets_file).get(source)
            return key or None
        return None

    def key_hint(self, source: str) -> str:
        """Where ``source``'s key is looked for (for a status line: the variable's name, never its value)."""
        env = self.source(source).api_key_env or KEY_ENVS.get(source)
        where = [f"${env}"] if env else []
        if self.secrets_file is not None:
            where.append(f"{self.secrets_file}:{source}")
        return " or ".join(where) or "no key needed"


def _read_secrets(path: Path) -> dict[str, str]:
    """``{source: key}`` from a YAML secrets file; ``ValueError`` naming the file and the offending entry's name
    (a key given twice: its name and both lines, as in every config file; the last one used to win silently)."""
    import yaml

    try:
        data = read_document(path, Path(path).read_text(), as_json=False) or {}
    except OSError as e:
        raise ValueError(f"secrets_file={str(path)!r}: cannot read ({e.strerror or e})") from None
    except DuplicateKeyError as e:  # names the key and its lines, never a value
        raise ValueError(f"secrets_file={str(path)!r}: {e}") from None
    except yaml.YAMLError:
        raise ValueError(f"secrets_file={str(path)!r}: not valid YAML") from None  # no excerpt: it may hold a key
    if not isinstance(data, dict):
        raise ValueError(f"secrets_file={str(path)!r}: must hold a mapping of source name -> API key")
    for k, v in data.items():
        if k not in KEY_ENVS:
            raise ValueError(f"secrets_file={str(path)!r}: {k!r} is not a source with a key "
                             f"({', '.join(KEY_ENVS)})")
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"secrets_file={str(path)!r}: the key of {k!r} is not a non-empty string")
    return {str(k): str(v).strip() for k, v in data.items()}
