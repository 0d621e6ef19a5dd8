"""``fedbroker cost reconcile``: the ledger of a real SQLite store against a CUR-like CSV and a pool's meter."""

from __future__ import annotations

import json
from datetime import timedelta

import yaml
from typer.testing import CliRunner

from broker.cli.main import app
from broker.service.reconcile import CUR_COLUMNS
from tests.broker.service.test_ledger import _prices  # noqa: F401 (autouse: the test prices, removed after)
from tests.broker.service.test_ledger import AWS_OD, DAY0, cloud_job, iid, run_ranks


def _setup(sqlite_store, tmp_path, bill_usd: float):
    t0 = DAY0 + timedelta(hours=9)
    jid = cloud_job(sqlite_store, AWS_OD, t0)
    run_ranks(sqlite_store, jid, 1, t0, [(0, 0, t0 + timedelta(seconds=45))])  # billed 60 s: 0.051 USD
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(yaml.safe_dump({"database_url": sqlite_store.url}))
    cur = tmp_path / "cur.csv"
    cur.write_text(",".join(CUR_COLUMNS) + "\n"
                   f"{iid(jid, 1, 0)},2024-03-05T09:00:00Z,2024-03-05T09:00:45Z,{bill_usd}\n"
                   "i-orphan,2024-03-05T10:00:00Z,2024-03-05T11:00:00Z,3.06\n")
    return jid, cfg, cur


def test_reconcile_prints_total_allocated_and_unallocated(sqlite_store, tmp_path):
    jid, cfg, cur = _setup(sqlite_store, tmp_path, 0.051)
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01", "--cur", str(cur),
                                 "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert ("aws 2024-03-01..2024-04-01: provider total $3.1110 = allocated to jobs $0.0510 + unallocated $3.0600 "
            "(idle lines $0.0000, not in the ledger $3.0600)" in " ".join(r.output.split()))
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01", "--cur", str(cur),
                                 "--config", str(cfg), "--json"])
    out = json.loads(r.output)
    assert out["cloud"]["differences"] == [] and abs(out["cloud"]["unallocated_usd"] - 3.06) < 1e-9


def test_reconcile_names_a_resource_billed_differently_and_exits_1(sqlite_store, tmp_path):
    jid, cfg, cur = _setup(sqlite_store, tmp_path, 0.0765)  # the bill says 90 s
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01", "--cur", str(cur),
                                 "--config", str(cfg)])
    assert r.exit_code == 1
    text = " ".join(r.output.split())
    assert "1 resource(s) where the ledger and the bill differ" in text
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01", "--cur", str(cur),
                                 "--config", str(cfg), "--json"])
    assert r.exit_code == 1
    [d] = json.loads(r.output)["cloud"]["differences"]
    assert d["resource"] == iid(jid, 1, 0) and abs(d["difference_usd"] - 0.0255) < 1e-9


def test_reconcile_bad_input_exits_2_naming_the_option(sqlite_store, tmp_path):
    jid, cfg, cur = _setup(sqlite_store, tmp_path, 0.051)
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "March", "--to", "2024-04-01", "--cur", str(cur),
                                 "--config", str(cfg)])
    assert r.exit_code == 2 and "--from='March': not a date" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01", "--pool", "site",
                                 "--config", str(cfg)])
    assert r.exit_code == 2 and "--pool and --metered-kwh go together" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["cost", "reconcile", "--from", "2024-03-01", "--to", "2024-04-01",
                                 "--pool", "site", "--metered-kwh", "2", "--config", str(cfg)])
    assert r.exit_code == 0 and "pool site: metered 2.000 kWh = allocated to jobs 0.000 kWh" in " ".join(r.output.split())
