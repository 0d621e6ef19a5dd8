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

Pool kinds (:data:`POOL_KINDS`): the schedulers teams already run, whose clusters the broker uses as on-prem
pools (issue #14). A pool of the cluster file says its ``kind`` and gives a section of that name; each
:class:`PoolKind` names:

* ``settings`` — ``settings_from_mapping(section, where) -> settings``: the section checked (``ValueError``
  naming ``where`` and the key);
* ``adapter`` — ``factory(settings) -> pool``: the adapter, with the method set of
  :class:`providers.slurm.SlurmPool` (``capacity``, ``free_gpus``, ``backlog``, ``release_profile``,
  ``submit``, ``describe``, ``cancel``, ``poll``, ``list_managed``, ``sweep``);
* ``request`` — the job request class ``submit`` takes (a dataclass; the broker passes those of ``job_id``,
  ``attempt``, ``team``, ``command`` (one shell line), ``gpu_type`` (the cluster's name), ``gpus_per_node``,
  ``nodes``, ``estimate_s``, ``deadline``, ``env``, ``priority_class``, ``image`` that it has).

What the live broker (:mod:`broker.service.schedulers`) reads of the job records ``submit``, ``describe``,
``poll`` and ``cancel`` return: the fields of :class:`providers.base.PoolJobInfo` (``pool_job_id``: the
cluster's job id; ``state``: the lifecycle state; ``pool_state``; ``active``; ``terminal``; ``exit_code``;
``signal``; ``reason``; ``nodes``; ``elapsed_s``; ``tags`` with ``fedbroker-job`` and ``fedbroker-attempt``;
``stdout``), and of ``capacity()`` the fields of :class:`providers.base.NodeCapacity` (``node``, ``state``,
``gpus_total``, ``gpus_free(type)``). Optional: ``pending_work()`` (else ``backlog()`` with no GPU-seconds) and
``consumed_energy_j(id)``.

``agent`` pools (hosts running ``fedbroker serve agent``) have no entry: the broker drives them itself.
Adding a kind: its module under ``providers/`` and one line in :data:`POOL_KINDS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["ProviderEntry", "PROVIDERS", "entry", "resolve", "build_adapters", "offer_allowed", "PoolKind",
           "POOL_KINDS", "AGENT_KIND", "pool_kind", "pool_settings", "build_pool"]


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


#: the kind of a pool of hosts running the broker's own node agent (no adapter: the broker drives them)
AGENT_KIND = "agent"


@dataclass(frozen=True)
class PoolKind:
    """One scheduler a pool can be run by (see the module docstring); references are ``"module:attribute"``."""

    name: str
    settings: str
    adapter: str
    request: str

    def load(self, what: str) -> Callable[..., Any]:
        """The callable this entry names for ``what`` (``"settings"``, ``"adapter"``, ``"request"``)."""
        ref = getattr(self, what)
        try:
            return resolve(ref)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"kind={self.name!r}: its {what} {ref!r} is not available in this installation "
                             f"({type(e).__name__}: {e})") from None


#: pool kind -> entry. The one list of the existing schedulers the broker federates (one line per kind).
POOL_KINDS: dict[str, PoolKind] = {
    "slurm": PoolKind("slurm", "providers.slurm:settings_from_mapping", "providers.slurm:SlurmPool",
                      "providers.base:PoolJobRequest"),
    "kubernetes": PoolKind("kubernetes", "providers.kubernetes:settings_from_mapping",
                           "providers.kubernetes:KubernetesPool", "providers.base:PoolJobRequest"),
}


def pool_kind(name: str) -> PoolKind:
    """The entry of pool kind ``name``; ``ValueError`` naming the known kinds (``agent`` included) if none."""
    try:
        return POOL_KINDS[name]
    except KeyError:
        raise ValueError(f"kind={name!r}: must be one of {', '.join([AGENT_KIND, *POOL_KINDS])}") from None


def pool_settings(kind: str, section: Any, where: str) -> Any:
    """The settings object of a ``kind`` pool from its cluster-file ``section``; ``ValueError`` naming ``where``
    and the key for a bad section (the kind's ``settings_from_mapping``)."""
    try:
        parse = pool_kind(kind).load("settings")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return parse(section, where)


def build_pool(kind: str, section: Any, where: str = "pool") -> Any:
    """The adapter of a ``kind`` pool from its cluster-file ``section`` (:func:`pool_settings`, then the kind's
    factory). Raises ``ValueError`` for an unknown kind or a bad section."""
    return pool_kind(kind).load("adapter")(pool_settings(kind, section, where))
