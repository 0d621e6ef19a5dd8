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

Source names (:data:`SOURCE_KINDS`): ``electricitymaps`` (carbon, key ``ELECTRICITYMAPS_API_KEY``),
``entsoe-day-ahead`` (price, key ``ENTSOE_API_KEY``), ``tariff`` (price, from ``tariffs``), ``bundled`` (both:
the 2023-24 history replayed by whole weeks; it is the planner's last resort whether listed or not, and if
listed it must come last). The GB Carbon Intensity API is not
accepted: it publishes operational gCO2/kWh, and the planner weighs life-cycle gCO2e/kWh (mixing them would
make GB look ~10-20 % greener than its neighbours).

API keys come from the environment variable (``sources.<name>.api_key_env``, default the source's own) or
else from ``secrets_file`` (a YAML mapping ``source name -> key``); they are never part of the settings
object, never logged and never put in an error or an explain record. Errors name the field and value
(:class:`ValueError`, turned into :class:`broker.service.settings.SettingsError` by ``load_settings``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pricing.carbon_sources import ELECTRICITYMAPS_KEY_ENV
from pricing.price_sources import ENTSOE_KEY_ENV, Tariff, TariffError

__all__ = ["SignalsSettings", "ZoneSignals", "SourceSettings", "SOURCE_KINDS", "KEY_ENVS", "BUNDLED"]

#: the bundled 2023-24 history replayed by whole weeks (always the last resort)
BUNDLED = "bundled"
#: source name -> the signal kinds it serves ("carbon": life-cycle gCO2e/kWh, "price": USD/MWh)
SOURCE_KINDS: dict[str, tuple[str, ...]] = {"electricitymaps": ("carbon",), "entsoe-day-ahead": ("price",),
                                            "tariff": ("price",), BUNDLED: ("carbon", "price")}
#: source name -> default environment variable of its API key (sources that need one)
KEY_ENVS: dict[str, str] = {"electricitymaps": ELECTRICITYMAPS_KEY_ENV, "entsoe-day-ahead": ENTSOE_KEY_ENV}
_GB = "gb-carbon-intensity"


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


class SignalsSettings(BaseModel):
    """The ``signals:`` section (see the module docstring). Fields (units): ``zones``, ``sources``, ``tariffs``,
    ``secrets_file``, ``refresh_s`` (seconds, >= 60), ``stale_after_s`` (seconds), ``history_h`` and
    ``forecast_h`` (hours)."""

    model_config = ConfigDict(extra="forbid")

    zones: dict[str, ZoneSignals] = Field(default_factory=dict)
    sources: dict[str, SourceSettings] = Field(default_factory=dict)
    tariffs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    secrets_file: Path | None = None
    refresh_s: float = Field(900.0, ge=60, le=7 * 86400)
    stale_after_s: float = Field(3 * 3600.0, gt=0, le=30 * 86400)
    history_h: int = Field(24, ge=1, le=24 * 14)
    forecast_h: int = Field(72, ge=1, le=24 * 14)

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, v: dict[str, SourceSettings]) -> dict[str, SourceSettings]:
        for name in v:
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
                    if name == _GB:
                        raise ValueError(f"{field}: {_GB!r} publishes operational gCO2/kWh; the planner weighs "
                                         "life-cycle gCO2e/kWh (use electricitymaps for GB)")
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
    """``{source: key}`` from a YAML secrets file; ``ValueError`` naming the file and the offending entry's name."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"secrets_file={str(path)!r}: cannot read ({e.strerror or e})") from None
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
