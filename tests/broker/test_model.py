"""One definition of each domain constant and rule (issue #10 item 7), pinned by hand-worked numbers, and the
places that use them agree (the store, the trace loaders, the planner, the simulator, the live cycle)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

import broker.model as model
from broker.model import (DEFAULT_CHECKPOINT_INTERVAL_S, DEFAULT_MIN_SLACK_S, FAIR_SHARE_HALF_LIFE_S, WEEK_S, JobSpec,
                          default_slack_s)

T = datetime(2023, 9, 4, tzinfo=timezone.utc)


def test_the_constants_have_their_documented_values():
    assert WEEK_S == 604800.0
    assert FAIR_SHARE_HALF_LIFE_S == 604800.0
    assert DEFAULT_CHECKPOINT_INTERVAL_S == 1800.0
    assert DEFAULT_MIN_SLACK_S == 43200.0


@pytest.mark.parametrize("duration_s, factor, min_slack_s, slack_s", [
    (3600.0, 1.0, 43200.0, 43200.0),     # a 1 h job: the 12 h minimum
    (86400.0, 1.0, 43200.0, 86400.0),    # a 24 h job: one duration
    (43200.0, 1.0, 43200.0, 43200.0),    # the two meet at 12 h
    (86400.0, 0.25, 3600.0, 21600.0),    # a quarter of 24 h beats a 1 h minimum
])
def test_default_slack_is_the_larger_of_factor_times_duration_and_the_minimum(duration_s, factor, min_slack_s, slack_s):
    assert default_slack_s(duration_s, factor, min_slack_s) == slack_s


def test_the_store_and_the_trace_loaders_give_a_job_without_deadline_the_same_deadline():
    from broker.service.store.core import default_deadline
    from broker.sim.traces import default_deadline_s

    for duration_s in (600.0, 43200.0, 100000.0):
        spec = JobSpec(command=["true"], estimated_duration_s=duration_s)
        got = default_deadline(T, spec)
        assert got == T + timedelta(seconds=duration_s + max(duration_s, 43200.0))
        assert default_deadline_s(T.timestamp(), duration_s) == got.timestamp()
    # a spec's own slack wins: 600 s + 60 s
    assert default_deadline(T, JobSpec(command=["true"], estimated_duration_s=600, slack_s=60)) == T + timedelta(seconds=660)


def test_every_default_checkpoint_interval_is_the_one_constant():
    from broker.planner.core import PendingJob, RunningJob
    from broker.service.cycle import FAIR_SHARE_HALF_LIFE_S as cycle_half_life
    from broker.service.lifecycle import checkpointed_work_s
    from broker.sim.simulator import SimulationConfig

    assert JobSpec(command=["true"]).checkpoint_interval_s == 1800.0
    pj = PendingJob(job_id="j", team="t", priority=1, submit_s=0.0, deadline_s=1e6, earliest_s=0.0, work_s=3600.0,
                    gpus_per_node=1, nodes=1)
    rj = RunningJob(job_id="j", pool=0, allocation=[(0, 1)], expected_end_s=1.0, started_s=0.0, priority=1,
                    preemptible=False)
    assert pj.checkpoint_interval_s == rj.checkpoint_interval_s == 1800.0
    # a stored spec without an interval keeps whole 30-min intervals: 5000 s run -> 2 x 1800 s kept
    assert checkpointed_work_s({}, 5000.0) == 3600.0
    assert SimulationConfig().fair_share_half_life_s == cycle_half_life == 604800.0


def test_a_week_of_decay_halves_usage_in_the_live_cycle():
    from broker.planner.fair_share import decayed_usage

    # one GPU for one second that ended exactly one half-life ago weighs ~1/2 GPU-second
    got = decayed_usage([("t", 1, 0.0, 1.0)], now_s=1.0 + WEEK_S)["t"] * 3600.0
    assert math.isclose(got, 0.5, rel_tol=1e-5)


def test_token_lifetimes_count_a_week_as_seven_days():
    from broker.service.tokens import parse_ttl

    assert parse_ttl("2w") == 2 * 604800.0


def test_the_offer_model_lives_in_pricing_and_broker_model_re_exports_it():
    import pricing.offers

    assert model.CloudOffer is pricing.offers.CloudOffer and model.Market is pricing.offers.Market
    assert pricing.offers.MIN_BILLED_S == 60.0


def test_the_job_uid_range_rule_is_one_rule_for_settings_and_agents():
    from broker.service.settings import JobsSettings
    from workers.isolation import check_uid_range

    import broker.job_uids as job_uids

    assert check_uid_range is job_uids.check_uid_range
    assert JobsSettings().uid_range == job_uids.DEFAULT_UID_RANGE == (61184, 65519)
    with pytest.raises(ValueError, match=r"jobs.uid_range=\[100, 114\]: holds 15 ids, at least 16 needed"):
        check_uid_range([100, 114])


def test_wait_text_never_rounds_seconds_to_zero_minutes():
    from broker.model import wait_text

    assert [wait_text(s) for s in (0.0, 40.0, 119.0, 222.0, 7199.0, 18720.0)] == [
        "0 s", "40 s", "119 s", "3.7 min", "120.0 min", "5.2 h"]


# ----------------------------------------------------------------------------- one-line text (issue #20 B7)
def _msg(**spec) -> str:
    """The message of the one error ``JobSpec(command=["true"], **spec)`` raises."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        JobSpec(command=["true"], **spec)
    [err] = e.value.errors()
    return str(err["ctx"]["error"])


@pytest.mark.parametrize("spec, msg", [
    ({"name": "abc\u202e"}, "name='abc\\u202e': contains the format character U+202E"),  # RIGHT-TO-LEFT OVERRIDE
    ({"name": "train\u202egnp.exe"}, "name='train\\u202egnp.exe': contains the format character U+202E"),
    ({"name": "a\u2066b\u2069"}, "name='a\\u2066b\\u2069': contains the format character U+2066"),  # first: LRI
    ({"name": "zero\u200bwidth"}, "name='zero\\u200bwidth': contains the format character U+200B"),
    ({"name": "\ufeffbom"}, "name='\\ufeffbom': contains the format character U+FEFF"),
    ({"name": "tag\U000e0041"}, "name='tag\\U000e0041': contains the format character U+E0041"),  # astral
    ({"name": "soft\u00adhyphen"}, "name='soft\\xadhyphen': contains the format character U+00AD"),
    ({"gpu_types": ["A100", "H100\u200d"]}, "gpu_types[1]='H100\\u200d': contains the format character U+200D"),
    ({"allowed_regions": ["us-east-1\u200e"]},
     "allowed_regions[0]='us-east-1\\u200e': contains the format character U+200E"),
    # control characters keep their message (the character's repr)
    ({"name": "a\x1b[2J"}, "name='a\\x1b[2J': contains the control character '\\x1b'"),
    ({"name": "a\u200bb\x07"}, "name='a\\u200bb\\x07': contains the format character U+200B"),  # the first one
    # not Cf, but a new line or nothing on screen (second hostile pass of 2026-12-04)
    ({"name": "one\u2028two"}, "name='one\\u2028two': contains the line-breaking or blank character U+2028"),
    ({"name": "\u3164"}, "name=" + repr("\u3164") + ": contains the line-breaking or blank character U+3164"),
    ({"name": "x\u115f"}, "name=" + repr("x\u115f") + ": contains the line-breaking or blank character U+115F"),
    ({"name": "a\u034fb"}, "name=" + repr("a\u034fb") + ": contains the line-breaking or blank character U+034F"),
])
def test_one_line_fields_refuse_format_characters_naming_field_value_and_code_point(spec, msg):
    assert _msg(**spec) == msg


@pytest.mark.parametrize("name", ["Übung-日本", "résumé v2", "обучение", "训练任务 #3", "مهمة-١", "עבודה",
                                  "🚀 llama-70b", "e\u0301", "tab-free  spaces", "\u2764\ufe0f train"])
def test_ordinary_non_ascii_names_are_accepted(name):
    # right-to-left letters (Arabic, Hebrew) and combining marks are letters and marks, not format characters
    assert JobSpec(command=["true"], name=name, gpu_types=[name[:64]], allowed_regions=[name[:64]]).name == name


def test_the_format_character_table_is_unicode_category_cf():
    import sys
    import unicodedata

    cf = {c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"}
    table = {c for a, b in model.FORMAT_CHAR_RANGES for c in range(a, b + 1)}
    assert table == cf, (f"update broker.model.FORMAT_CHAR_RANGES to Unicode {unicodedata.unidata_version}: "
                         f"missing {sorted(map(hex, cf - table))}, extra {sorted(map(hex, table - cf))}")


def _no_cf_no_cc():
    from hypothesis import strategies as st

    return st.text(st.characters(exclude_categories=("Cc", "Cf", "Cs")), max_size=31)  # 63 with the Cf: fits a gpu type (64)


def test_any_text_with_a_format_character_is_refused_naming_the_field():
    import unicodedata

    from hypothesis import given, settings, strategies as st

    @settings(max_examples=300, deadline=None)
    @given(head=_no_cf_no_cc(), tail=_no_cf_no_cc(), ch=st.characters(categories=("Cf",)),
           field=st.sampled_from(["name", "gpu_types", "allowed_regions"]))
    def check(head, tail, ch, field):
        assert unicodedata.category(ch) == "Cf"
        v = head + ch + tail
        msg = _msg(**{field: v if field == "name" else ["ok", v]})
        shown = f"{field}[1]" if field != "name" else field
        assert msg == f"{shown}={v[:40]!r}: contains the format character U+{ord(ch):04X}"
        assert model.line_problem(v) == f"contains the format character U+{ord(ch):04X}"

    check()


def test_the_schema_pattern_is_the_validator():
    """``LINE_PATTERN`` (the JSON schema's, what schemathesis generates from) accepts exactly the strings
    :func:`broker.model.line_problem` passes, after a JSON round trip (as a client reads /openapi.json)."""
    import json
    import re

    from hypothesis import given, settings, strategies as st

    # fullmatch: JSON schema's ECMAScript "$" is the end of the text; Python's also matches before a final "\n"
    pattern = re.compile(json.loads(json.dumps(model.LINE_PATTERN)))
    assert json.loads(json.dumps(model.LINE_PATTERN, ensure_ascii=True)) == model.LINE_PATTERN
    for a, b in model.FORMAT_CHAR_RANGES:  # each range's ends and the characters just outside it
        for c in (a - 1, a, b, b + 1):
            assert (pattern.fullmatch(chr(c)) is None) == (model.line_problem(chr(c)) is not None), hex(c)

    @settings(max_examples=500, deadline=None)
    @given(v=st.text(st.characters(exclude_categories=("Cs",)), max_size=30))
    def check(v):
        assert (pattern.fullmatch(v) is not None) == (model.line_problem(v) is None)

    check()
    schema = JobSpec.model_json_schema()["properties"]
    assert schema["name"]["anyOf"][0]["pattern"] == model.LINE_PATTERN
    assert schema["gpu_types"]["items"]["pattern"] == schema["allowed_regions"]["items"]["pattern"] == model.LINE_PATTERN
