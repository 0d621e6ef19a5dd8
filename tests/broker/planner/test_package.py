"""The planner package's shape: every policy name has one module in the registry; the package does no I/O."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker.planner.core import POLICY_NAMES, PlannerConfig, PolicyName
from broker.planner.registry import POLICIES, plan
from tests.broker.builders import T0, make_ctx, make_job, make_pool, make_snapshot

#: libraries that reach outside the process (ARCHITECTURE §2: the planner imports none of them)
IO_LIBRARIES = ("sqlalchemy", "redis", "celery", "requests", "boto3", "google", "fastapi", "kombu", "httpx")


def test_every_policy_name_has_one_registry_row():
    assert POLICY_NAMES == ("fifo", "backfill", "cheapest", "federated")
    assert list(POLICIES) == list(PolicyName)
    assert {p.value: POLICIES[p].uses_cloud for p in PolicyName} == {
        "fifo": False, "backfill": False, "cheapest": True, "federated": True}
    assert {name: POLICIES[name].decide.__module__ for name in POLICY_NAMES} == {
        name: f"broker.planner.{name}" for name in POLICY_NAMES}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_plan_runs_the_policy_the_config_names(name):
    ctx = make_ctx([make_pool().node("V100", 4).build()], policy=name)
    assert ctx.config.policy == name and ctx.config.policy is PolicyName(name)
    (d,) = plan(make_snapshot(T0, [make_job("j").gpus(2).build()], [[4]]), ctx)
    assert (d.job_id, d.kind.value, d.allocation) == ("j", "start", ((0, 2),))


def test_config_rejects_an_unknown_policy_naming_the_choices():
    with pytest.raises(ValueError, match="'fifo', 'backfill', 'cheapest' or 'federated'"):
        PlannerConfig(policy="random")


def test_the_planner_package_imports_no_io_library():
    code = ("import sys, pkgutil, importlib, broker.planner as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('broker.planner.' + m.name)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {IO_LIBRARIES!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "[]"
