"""The provider registry: one line per place cloud jobs run, naming what the broker needs of it.

Each :class:`ProviderEntry` names, as ``"module:attribute"`` references resolved on first use (so this
module imports no provider SDK and nothing of ``broker``):

* ``adapter`` — the adapter factory: ``factory(section) -> providers.base.Compute`` from the provider's
  settings section;
* ``settings_section`` — the attribute of the broker settings that configures it (``settings.aws``);
* ``offers`` — the offer source: ``source(providers=(name,))`` gives its priced offers
  (``pricing.catalog.load_offers``);
* ``allows`` — ``allows(section, offer) -> bool``: the offer's zone is one the section has a network for;
* ``terraform`` — ``from_outputs([(path, outputs)]) -> section dict``: the settings section for the
  ``terraform output -json`` of its Terraform module (``fedbroker cloud settings-from-terraform``).

Adding a provider: its module under ``providers/`` (adapter + the functions above) and one line in
:data:`PROVIDERS`. Errors: ``ValueError`` naming an unknown provider.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["ProviderEntry", "PROVIDERS", "entry", "resolve", "build_adapters", "offer_allowed"]


@dataclass(frozen=True)
class ProviderEntry:
    """One provider (see the module docstring); references are ``"module:attribute"``."""

    name: str
    settings_section: str
    adapter: str
    offers: str
    allows: str
    terraform: str

    def load(self, what: str) -> Callable[..., Any]:
        """The callable this entry names for ``what`` (``"adapter"``, ``"offers"``, ``"allows"``, ``"terraform"``)."""
        return resolve(getattr(self, what))


#: provider name -> entry. The one list of the cloud providers the broker can provision on.
PROVIDERS: dict[str, ProviderEntry] = {
    "aws": ProviderEntry("aws", "aws", "providers.aws:compute_from_settings", "pricing.catalog:load_offers",
                         "providers.aws:offer_in_network", "providers.aws:settings_from_terraform"),
    "gcp": ProviderEntry("gcp", "gcp", "providers.gcp:compute_from_settings", "pricing.catalog:load_offers",
                         "providers.gcp:offer_in_network", "providers.gcp:settings_from_terraform"),
}


def entry(name: str) -> ProviderEntry:
    """The registry entry of provider ``name``; ``ValueError`` naming the known ones if there is none."""
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ValueError(f"provider={name!r}: must be one of {', '.join(PROVIDERS)}") from None


def resolve(ref: str) -> Callable[..., Any]:
    """The attribute a ``"module:attribute"`` reference names (the module is imported on first use)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_adapters(names: Iterable[str], section_of: Callable[[str], Any]) -> dict[str, Any]:
    """Provider name -> adapter for each of ``names``, each made by its entry's factory from
    ``section_of(entry.settings_section)``. Raises ``ValueError`` for an unknown provider."""
    out = {}
    for name in names:
        e = entry(name)
        out[name] = e.load("adapter")(section_of(e.settings_section))
    return out


def offer_allowed(names: Iterable[str], section_of: Callable[[str], Any], offer: Any) -> bool:
    """Whether ``offer`` (a ``CloudOffer``) may be provisioned: its provider is one of ``names`` and the
    provider's ``allows`` check passes for its settings section."""
    if offer.provider not in set(names) or offer.provider not in PROVIDERS:
        return False
    e = PROVIDERS[offer.provider]
    return bool(e.load("allows")(section_of(e.settings_section), offer))
