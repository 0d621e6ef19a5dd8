"""Provider adapters from the broker's settings, through :mod:`providers.registry` (one line per provider).

* :func:`build_computes` — provider name -> adapter for ``settings.cloud_providers``;
* :func:`offer_allowed` — may an offer be provisioned with these settings (its provider configured, its zone
  in a configured network).
"""

from __future__ import annotations

from providers.base import Compute
from providers.registry import build_adapters
from providers.registry import offer_allowed as _registry_allows

__all__ = ["build_computes", "offer_allowed"]


def build_computes(settings) -> dict[str, Compute]:
    """Provider adapters for ``settings.cloud_providers`` (:class:`broker.service.settings.BrokerSettings`), each
    made by its registry factory from its settings section (``settings.aws``, ``settings.gcp``). Raises
    ``ValueError`` for a provider the registry does not know."""
    return build_adapters(settings.cloud_providers, lambda section: getattr(settings, section))


def offer_allowed(settings, offer) -> bool:
    """May ``offer`` (a ``CloudOffer``) be provisioned: its provider is in ``cloud_providers`` and its zone
    is one the provider's settings have a network for (AWS: a subnet in ``subnet_ids_by_az`` or
    ``subnet_ids_by_az_id``; GCP: a zone of ``gcp.region``)."""
    return _registry_allows(settings.cloud_providers, lambda section: getattr(settings, section), offer)
