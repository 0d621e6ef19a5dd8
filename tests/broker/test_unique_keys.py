"""broker.unique_keys.read_document: the one reader of a config document, each key once per mapping at every depth."""

from __future__ import annotations

import json

import pytest
import yaml

from broker.unique_keys import DUPLICATE_KEY_ERRORS, DuplicateJsonKey, DuplicateKeyError, read_document


def test_reads_yaml_or_json_by_suffix_from_a_path(tmp_path):
    y, j = tmp_path / "c.yaml", tmp_path / "c.JSON"
    y.write_text("a: {b: [1, 2]}\n")
    j.write_text('{"a": {"b": [1, 2]}}')
    assert read_document(y) == read_document(j) == {"a": {"b": [1, 2]}}
    with pytest.raises(json.JSONDecodeError):  # JSON by its suffix: YAML's flow style is not JSON
        read_document(j, "a: 1\n")
    assert read_document(j, "a: 1\n", as_json=False) == {"a": 1}
    with pytest.raises(json.JSONDecodeError):
        read_document(y, "a: 1\n", as_json=True)


def test_text_or_utf8_bytes_instead_of_the_file(tmp_path):
    assert read_document("given", "x: é\n") == {"x": "é"}
    assert read_document("given", "x: é\n".encode()) == {"x": "é"}
    assert read_document("body", '{"x": "é"}'.encode(), as_json=True) == {"x": "é"}
    with pytest.raises(UnicodeDecodeError):
        read_document("body", b'{"x": "\xe9"}', as_json=True)
    with pytest.raises(FileNotFoundError):
        read_document(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, key, message", [
    ("a: 1\na: 2\n", "a", "key 'a' appears twice (lines 1 and 2)"),
    ("top:\n  - x: 1\n    y: {z: 1, z: 2}\n", "z", "key 'z' under 'top.0.y' appears twice (lines 3 and 3)"),
])
def test_a_yaml_key_twice_at_any_depth_names_the_file_key_and_lines(tmp_path, text, key, message):
    f = tmp_path / "doc.yaml"
    f.write_text(text)
    with pytest.raises(DuplicateKeyError) as e:
        read_document(f)
    assert (e.value.source, e.value.key, str(e.value)) == (str(f), key, message)
    assert isinstance(e.value, yaml.YAMLError) and isinstance(e.value, DUPLICATE_KEY_ERRORS)


def test_a_json_key_twice_at_any_depth_names_the_file_and_key(tmp_path):
    f = tmp_path / "doc.json"
    f.write_text('{"a": [{"b": 1}, {"b": 2}], "c": [{"d": {"e": 1, "e": 2}}]}')
    with pytest.raises(DuplicateJsonKey) as e:
        read_document(f)
    assert (e.value.source, e.value.key) == (str(f), "e")
    assert str(e.value) == "key 'e' appears twice in one object (refused: the last would silently win)"
    assert isinstance(e.value, DUPLICATE_KEY_ERRORS)


def test_merge_keys_may_still_override():
    assert read_document("m.yaml", "base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n") == {
        "base": {"x": 1, "y": 2}, "d": {"x": 3, "y": 2}}
