"""Reading YAML and JSON with each key once per mapping: plain ``yaml.safe_load`` and ``json.loads`` keep the last of
two equal keys silently (``gpus_per_node: 1`` then ``4`` made a 4-GPU job). :func:`read_document` is the one
reader of a config document, for the cluster file (:func:`broker.cluster.load_cluster`), job files
(``fedbroker submit``), the settings file (``FEDBROKER_CONFIG``), the signals ``secrets_file`` and API request
bodies (:mod:`broker.service.jsonbody`); :func:`load_yaml` and :func:`loads_strict` are its two parsers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_document", "DUPLICATE_KEY_ERRORS", "DuplicateKeyError", "UniqueKeyLoader", "load_yaml",
           "DuplicateJsonKey", "unique_json_object", "loads_strict"]


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping holds the same key twice (``path``: the keys of the mappings above it)."""

    #: the document's path or name, set by :func:`read_document` (the message leaves it to the caller's prefix)
    source: str | None = None

    def __init__(self, key: Any, first_line: int, second_line: int, path: tuple = ()):
        self.key, self.first_line, self.second_line, self.path = key, first_line, second_line, path
        where = f" under {'.'.join(map(str, path))!r}" if path else ""
        super().__init__(f"key {key!r}{where} appears twice (lines {first_line} and {second_line})")


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`DuplicateKeyError` on a mapping key given twice (plain
    ``safe_load`` keeps the last one silently: two pasted ``settings-from-terraform`` outputs would drop a
    provider). Merge keys (``<<: *anchor``) may still be overridden, as YAML intends. A document whose aliases
    expand it beyond :attr:`MAX_EXPANDED_NODES` values raises ``yaml.YAMLError``."""

    #: most nodes a document may expand to with its aliases (a "billion laughs" document of nine nested
    #: lists of nine aliases expands to 10^9 and took minutes to validate)
    MAX_EXPANDED_NODES = 100_000

    def construct_document(self, node):
        if self._expanded_size(node, {}) > self.MAX_EXPANDED_NODES:
            raise yaml.YAMLError(f"the document expands to more than {self.MAX_EXPANDED_NODES} values through "
                                 "its aliases (*name); write them out")
        self._check_unique(node, (), set())
        return super().construct_document(node)

    def _expanded_size(self, node, sizes: dict) -> int:
        """How many nodes ``node`` stands for with every alias expanded (memoised per node: linear time)."""
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a cycle (a recursive alias) counts once
        n = 1
        if isinstance(node, yaml.MappingNode):
            n += sum(self._expanded_size(k, sizes) + self._expanded_size(v, sizes) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(self._expanded_size(v, sizes) for v in node.value)
        sizes[id(node)] = n
        return n

    def _check_unique(self, node, path: tuple, seen_nodes: set) -> None:
        if id(node) in seen_nodes:  # an alias: checked where the anchor is
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    self._check_unique(value_node, path, seen_nodes)
                    continue
                line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)
                    if key in first:
                        raise DuplicateKeyError(key, first[key], line, path)
                    first[key] = line
                else:  # a complex key (a list or mapping): only its own contents are checked
                    key = "?"
                    self._check_unique(key_node, path + (key,), seen_nodes)
                self._check_unique(value_node, path + (key,), seen_nodes)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, path + (i,), seen_nodes)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` on a key given twice in one mapping."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


class DuplicateJsonKey(ValueError):
    """A JSON object holds the same key twice (``key``: that key; no line: ``json`` does not say where)."""

    #: the document's path or name, set by :func:`read_document` (the message leaves it to the caller's prefix)
    source: str | None = None

    def __init__(self, key: str):
        self.key = key
        super().__init__(f"key {key!r} appears twice in one object (refused: the last would silently win)")


def unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict; :class:`DuplicateJsonKey`
    if a key appears twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateJsonKey(k)
        out[k] = v
    return out


def loads_strict(raw: bytes | str) -> Any:
    """``json.loads`` refusing duplicate keys. Raises :class:`DuplicateJsonKey`, :class:`UnicodeDecodeError`
    (bytes that are not UTF-8) or :class:`json.JSONDecodeError`."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    return json.loads(text, object_pairs_hook=unique_json_object)


#: what :func:`read_document` raises for a key given twice: YAML (with both lines) or JSON
DUPLICATE_KEY_ERRORS = (DuplicateKeyError, DuplicateJsonKey)


def read_document(source: str | Path, text: str | bytes | None = None, *, as_json: bool | None = None) -> Any:
    """The data of one YAML or JSON config document, each key once per mapping (object) at every depth.

    ``source``: the document's path, read as UTF-8 when ``text`` is ``None``, else the name of ``text`` (bytes are
    decoded as UTF-8). JSON when ``as_json``, YAML when it is ``False``; with ``None``, JSON for a ``source``
    whose suffix is ``.json`` (any case), else YAML.

    Raises (each caller words them, naming the file): :class:`OSError` (cannot read), :class:`UnicodeDecodeError`
    (not UTF-8), :class:`DuplicateKeyError` (YAML: the key, the mapping it is in, both lines) or
    :class:`DuplicateJsonKey` (the key), both with ``source`` set; else ``yaml.YAMLError`` or
    :class:`json.JSONDecodeError` (``ValueError`` or ``RecursionError`` for JSON too big a number or too deep)."""
    name = str(source)
    if text is None:
        text = Path(source).read_text(encoding="utf-8")
    if as_json is None:
        as_json = Path(name).suffix.lower() == ".json"
    try:
        return loads_strict(text) if as_json else load_yaml(text.decode("utf-8") if isinstance(text, bytes) else text)
    except DUPLICATE_KEY_ERRORS as e:
        e.source = name
        raise
