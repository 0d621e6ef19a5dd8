"""Settings of the live broker: one typed schema, from a YAML file plus environment variables.

Precedence (highest first): keyword arguments, environment variables
``FEDBROKER_<FIELD>`` (nested with ``__``, e.g. ``FEDBROKER_PLANNER__POLICY=backfill``),
the YAML file named by ``FEDBROKER_CONFIG`` (or passed to :func:`load_settings`),
then the defaults below. Unknown keys in the file are errors naming the key.

Defaults run everything on one machine: SQLite under ``state_dir``, Redis on
127.0.0.1:6379, the API on 127.0.0.1:8600, the planner every 2 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from broker.planner import PlannerConfig

__all__ = ["BrokerSettings", "load_settings", "SettingsError"]


class SettingsError(ValueError):
    """The settings file or environment is invalid; the message names the key and value."""


class BrokerSettings(BaseSettings):
    """Everything the API, Celery workers, beat and node agents read.

    Fields (units):
        database_url: SQLAlchemy URL of the job store; ``postgresql+psycopg://...`` in
            production, ``sqlite:///PATH`` for a single-machine trial (default: ``state_dir/fedbroker.db``).
        database_schema: PostgreSQL schema holding the tables (``None`` = the default ``search_path``).
        redis_url: Celery broker and the planner's leader lock.
        state_dir: where the embedded database, node agents' job directories and logs live.
        api_host, api_port: where ``fedbroker serve api`` listens.
        api_url: where the SDK and CLI reach the API.
        cluster: YAML file of on-prem pools (site, grid zones, PUE, $/GPU-h); node agents
            register the hosts. ``None`` = the bundled ``broker/data/local_cluster.yaml``.
        planner: the planner's settings (policy, carbon price, ...), see :class:`PlannerConfig`.
        cloud_providers: cloud providers whose offers may be provisioned; empty = on-prem only
            (cloud offers are still costed and shown as alternatives in explain records).
        plan_interval_s: seconds between planning cycles (beat).
        reconcile_interval_s: seconds between reconciler passes (beat).
        heartbeat_interval_s: seconds between node-agent heartbeats.
        node_lost_after_s: a node silent this long is lost; its jobs are requeued.
        dispatch_retry_s: a ``starting`` job not yet running is re-dispatched after this many seconds.
        starting_deadline_s: a job still ``starting`` after this long goes back to the queue.
        provisioning_deadline_s: a job still ``provisioning`` after this long goes back to the queue.
        cancel_grace_s: seconds between SIGTERM and SIGKILL when a job is cancelled or preempted.
        planner_lock_ttl_s: TTL of the planner's Redis lock (a crashed leader frees it after this).
        log_chunk_bytes, log_max_bytes: log shipping chunk size and cap per attempt and rank, bytes.
        admin_token: if set, an admin API token that always works (bootstrap); prefer ``fedbroker tokens create``.
        max_attempts: a job whose attempts keep ending without an exit code (node lost, start
            timed out, could not be launched) fails after this many attempts.
    """

    model_config = SettingsConfigDict(env_prefix="FEDBROKER_", env_nested_delimiter="__", extra="forbid")

    database_url: str | None = None
    database_schema: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    state_dir: Path = Path(".fedbroker")
    api_host: str = "127.0.0.1"
    api_port: int = Field(8600, ge=1, le=65535)
    api_url: str | None = None
    cluster: Path | None = None
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    cloud_providers: tuple[str, ...] = ()
    plan_interval_s: float = Field(2.0, gt=0)
    reconcile_interval_s: float = Field(5.0, gt=0)
    heartbeat_interval_s: float = Field(2.0, gt=0)
    node_lost_after_s: float = Field(30.0, gt=0)
    dispatch_retry_s: float = Field(10.0, gt=0)
    starting_deadline_s: float = Field(120.0, gt=0)
    provisioning_deadline_s: float = Field(900.0, gt=0)
    cancel_grace_s: float = Field(10.0, ge=0)
    planner_lock_ttl_s: float = Field(60.0, gt=0)
    log_chunk_bytes: int = Field(64 * 1024, ge=1024)
    log_max_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    admin_token: str | None = None
    max_attempts: int = Field(5, ge=1)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("cloud_providers")
    @classmethod
    def _providers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if p not in ("aws", "gcp"):
                raise ValueError(f"cloud_providers: {p!r} is not a known provider (aws, gcp)")
        if v:
            raise ValueError(f"cloud_providers={list(v)!r}: provider adapters are not built yet; "
                             "leave it empty (cloud offers are still costed in explain records)")
        return v

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)

    # ------------------------------------------------------------------ derived
    @property
    def effective_database_url(self) -> str:
        """``database_url`` or the embedded SQLite file under ``state_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.state_dir / 'fedbroker.db').resolve()}"

    @property
    def effective_api_url(self) -> str:
        return self.api_url or f"http://{self.api_host}:{self.api_port}"


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by ``FEDBROKER_CONFIG`` (a mapping of the fields above)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("FEDBROKER_CONFIG")
        if not path:
            return {}
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except OSError as e:
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: cannot read ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise SettingsError(f"FEDBROKER_CONFIG={path!r}: must hold a mapping of settings, got {type(data).__name__}")
        return data


def load_settings(config: str | Path | None = None, **overrides) -> BrokerSettings:
    """Settings from ``config`` (or ``$FEDBROKER_CONFIG``), the environment and ``overrides``.

    Raises :class:`SettingsError` naming the first bad key and value.
    """
    old = os.environ.get("FEDBROKER_CONFIG")
    try:
        if config is not None:
            os.environ["FEDBROKER_CONFIG"] = str(config)
        return BrokerSettings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise SettingsError(f"setting {loc}={err.get('input')!r}: {err['msg']}") from None
    finally:
        if config is not None:
            if old is None:
                os.environ.pop("FEDBROKER_CONFIG", None)
            else:
                os.environ["FEDBROKER_CONFIG"] = old
