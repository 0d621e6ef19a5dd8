"""On-prem cluster configuration: load :class:`broker.model.Pool` objects from YAML or JSON.

File format (YAML; JSON with the same structure also works, chosen by the
``.json`` suffix)::

    pools:                       # or the list of pools at the top level
      - name: bay-area
        site: "Bay Area, California (CAISO grid)"
        carbon_zone: US-CAL-CISO # zone of the hourly carbon series (gCO2e/kWh)
        price_zone: US-CAL-CISO  # zone of the hourly electricity price series (USD/MWh)
        pue: 1.3
        amortised_usd_per_gpu_hour: 0.55
        node_groups:             # compact form, expanded into PoolNode objects
          - {count: 48, gpu_type: V100, gpus_per_node: 8, gpu_memory_gb: 16, name_prefix: "v100-"}
        nodes:                   # and/or explicit nodes (PoolNode fields)
          - {name: odd-1, gpu_type: A100, gpu_count: 4, gpu_memory_gb: 40}
      - name: hpc                # an existing Slurm cluster (issue #14): its nodes come from the cluster
        kind: slurm              # agent (default: hosts running `fedbroker serve agent`) | slurm | kubernetes
        carbon_zone: CA-ON
        price_zone: CA-ON
        pue: 1.2
        amortised_usd_per_gpu_hour: 0.40
        slurm:                   # the kind's section: providers.slurm.settings_from_mapping's keys
          partition: gpu
          rest_url: http://slurm-head:6820   # or leave it out: the CLI (bin_dir, slurm_conf)
          jwt_file: /etc/fedbroker/slurm.jwt
          rest_user: fedbroker
          qos_by_class: {high: urgent}
          log_dir: /shared/fedbroker/logs    # 0700, owned by the account jobs run as (rest_user / submit_user)
          checkpoint_root: /shared/fedbroker/ckpt
          gres_types: {gpu: A100}            # an untyped GRES (gpu:4) is this GPU type

A pool's ``kind`` selects its adapter in :data:`providers.registry.POOL_KINDS`; the section named after the
kind is checked by the kind's ``settings_from_mapping`` here, so a bad key or value is reported with its path
(``pools[1].slurm.partition``). A scheduler's pool needs no ``nodes``: the live broker reads them from the
cluster; nodes given for it serve ``fedbroker simulate`` only.

A node group of ``count`` ``c`` expands to nodes named ``name_prefix`` + a
zero-padded index ``0 .. c-1`` (``v100-00`` .. ``v100-47``); ``name_prefix``
defaults to ``<pool>-<gpu_type lowercase>-``. Explicit ``nodes`` come first,
then the groups in order. Node names must be unique within a pool and pool
names unique within the file.

The bundled default (:data:`DEFAULT_CLUSTER_PATH`) is one 384-GPU V100 pool in
the CAISO zone; its YAML explains the PUE and amortised-cost assumptions.

Errors: :class:`ClusterError` (a ``ValueError``) naming the file and the field
path (``pools[0].node_groups[0].count``), wrapping YAML/JSON syntax errors and
pydantic's ``ValidationError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker import DATA_DIR
from broker.model import Pool, PoolNode, PriorityClass, short_repr
from broker.unique_keys import DuplicateJsonKey, read_document
from providers.registry import AGENT_KIND, POOL_KINDS, pool_settings

__all__ = ["ClusterError", "NodeGroup", "load_cluster", "parse_cluster", "DEFAULT_CLUSTER_PATH"]

#: Bundled default cluster (one pool, 48 x 8 V100 16GB, US-CAL-CISO).
DEFAULT_CLUSTER_PATH = DATA_DIR / "default_cluster.yaml"


class ClusterError(ValueError):
    """A cluster file could not be loaded: names the file and the offending field."""


class NodeGroup(BaseModel):
    """Compact description of ``count`` identical nodes (GPU memory in GB)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int = Field(ge=1, le=100_000)
    gpu_type: str = Field(min_length=1)
    gpus_per_node: int = Field(ge=1, le=16)
    gpu_memory_gb: float = Field(16.0, gt=0)
    name_prefix: str | None = None

    def expand(self, pool_name: str) -> list[PoolNode]:
        """The ``count`` nodes of this group, names ``name_prefix`` + zero-padded index."""
        prefix = self.name_prefix if self.name_prefix is not None else f"{pool_name}-{self.gpu_type.lower()}-"
        width = len(str(self.count - 1))
        return [
            PoolNode(name=f"{prefix}{i:0{width}d}", gpu_type=self.gpu_type, gpu_count=self.gpus_per_node,
                     gpu_memory_gb=self.gpu_memory_gb)
            for i in range(self.count)
        ]


def _loc(prefix: str, loc: tuple[Any, ...]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _wrap(where: str, prefix: str, err: ValidationError) -> ClusterError:
    msgs = []
    for e in err.errors():
        field = _loc(prefix, tuple(e.get("loc", ())))
        val = e.get("input")
        vs = "" if isinstance(val, dict) else f" (got {short_repr(val, 80)})"  # a mapping: its fields are named
        msgs.append(f"{field}: {e.get('msg')}{vs}")
    return ClusterError(f"{where}: " + "; ".join(msgs))


def _scheduler_section(raw: dict, where: str, at: str) -> str:
    """Check pool ``raw``'s ``kind`` and move its scheduler section (the key named after the kind) to
    ``raw["scheduler"]``, checked by the kind's settings parser. Returns the kind. :class:`ClusterError` naming
    the field for an unknown kind, a missing section, or a section of another kind."""
    kind = raw.get("kind", AGENT_KIND)
    if not isinstance(kind, str) or (kind != AGENT_KIND and kind not in POOL_KINDS):
        raise ClusterError(f"{where}: {at}.kind: {kind!r} is not one of {', '.join([AGENT_KIND, *POOL_KINDS])}")
    if "scheduler" in raw:
        raise ClusterError(f"{where}: {at}.scheduler: not a cluster-file key; give the section as {at}.<kind>")
    for other in POOL_KINDS:
        if other != kind and other in raw:
            raise ClusterError(f"{where}: {at}.{other}: a {other!r} section on a pool of kind {kind!r} "
                               f"(set {at}.kind: {other})")
    if kind == AGENT_KIND:
        return kind
    section = raw.pop(kind, None)
    if section is None:
        raise ClusterError(f"{where}: {at}.{kind}: required for a pool of kind {kind!r} (how to reach the cluster)")
    try:
        pool_settings(kind, section, f"{at}.{kind}")
    except ValueError as e:
        raise ClusterError(f"{where}: {e}") from None
    classes = [c.value for c in PriorityClass]
    for key, mapping in section.items():  # qos_by_class, priority_class_by_class: keyed by the job's class
        if str(key).endswith("_by_class") and isinstance(mapping, dict):
            for cls in mapping:
                if cls not in classes:
                    raise ClusterError(f"{where}: {at}.{kind}.{key}: {cls!r} is not a priority class "
                                       f"({', '.join(classes)})")
    raw["scheduler"] = dict(section)
    return kind


def parse_cluster(data: Any, where: str = "<cluster>") -> list[Pool]:
    """Build pools from already-parsed YAML/JSON ``data`` (``{"pools": [...]}`` or a list).

    ``where`` names the source in error messages. Raises :class:`ClusterError`.
    """
    if isinstance(data, dict) and "pools" in data:
        extra = set(data) - {"pools"}
        if extra:
            raise ClusterError(f"{where}: unknown top-level field(s) {', '.join(sorted(map(str, extra)))}")
        raw_pools = data["pools"]
    else:
        raw_pools = data
    if not isinstance(raw_pools, list) or not raw_pools:
        raise ClusterError(f"{where}: pools: expected a non-empty list of pools")
    pools: list[Pool] = []
    names: set[str] = set()
    for i, raw in enumerate(raw_pools):
        at = f"pools[{i}]"
        if not isinstance(raw, dict):
            raise ClusterError(f"{where}: {at}: expected a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        groups_raw = raw.pop("node_groups", None) or []
        if not isinstance(groups_raw, list):
            raise ClusterError(f"{where}: {at}.node_groups: expected a list")
        pname = raw.get("name")
        if not isinstance(pname, str) or not pname:
            raise ClusterError(f"{where}: {at}.name: required, a non-empty string")
        nodes_raw = raw.get("nodes") or []
        if not isinstance(nodes_raw, list):
            raise ClusterError(f"{where}: {at}.nodes: expected a list")
        nodes: list[Any] = list(nodes_raw)
        for j, g in enumerate(groups_raw):
            try:
                grp = NodeGroup.model_validate(g)
            except ValidationError as e:
                raise _wrap(where, f"{at}.node_groups[{j}]", e) from None
            nodes.extend(grp.expand(pname))
        kind = _scheduler_section(raw, where, at)
        if not nodes and kind == AGENT_KIND:
            raise ClusterError(f"{where}: {at}.nodes: pool {pname!r} has no nodes (give nodes and/or node_groups)")
        raw["nodes"] = nodes
        try:
            pool = Pool.model_validate(raw)
        except ValidationError as e:
            raise _wrap(where, at, e) from None
        seen: set[str] = set()
        for node in pool.nodes:
            if node.name in seen:
                raise ClusterError(f"{where}: {at}.nodes: duplicate node name {node.name!r}")
            seen.add(node.name)
        if pool.name in names:
            raise ClusterError(f"{where}: {at}.name: duplicate pool name {pool.name!r}")
        names.add(pool.name)
        pools.append(pool)
    return pools


def load_cluster(path: str | Path | None = None) -> list[Pool]:
    """Load on-prem pools from a YAML (or ``.json``) file; default :data:`DEFAULT_CLUSTER_PATH`.

    Returns the pools in file order, node groups expanded into :class:`PoolNode`
    objects. Raises :class:`ClusterError` naming the file and field.
    """
    p = Path(path) if path is not None else DEFAULT_CLUSTER_PATH
    try:
        data = read_document(p)  # a key given twice is refused (plain safe_load keeps the last silently)
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterError(f"{p}: cannot read cluster file: {e}") from e
    except (json.JSONDecodeError, DuplicateJsonKey) as e:
        raise ClusterError(f"{p}: not valid JSON: {e}") from e
    except yaml.YAMLError as e:
        raise ClusterError(f"{p}: not valid YAML: {e}") from e
    return parse_cluster(data, str(p))
