"""``fedbroker budgets set/list/show/delete`` on a real PostgreSQL store, with hand-worked figures."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from broker.cli.main import app
from broker.service.budgets import month_bounds
from broker.service.store import usage
from broker.service.store.tables import utcnow
from tests.broker.service.test_budgets import _line, _place_cloud


def _cfg(store, tmp_path):
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(yaml.safe_dump({"database_url": store.url, "database_schema": store.schema}))
    return str(cfg)


def test_set_list_show_delete(pg_store, tmp_path):
    cfg = _cfg(pg_store, tmp_path)
    month0, _ = month_bounds(utcnow())
    with pg_store.session() as s:
        usage.add_usage(s, [_line("job-a", "ml", month0, 40.0)], month0)  # spent this month
    _place_cloud(pg_store, "ml", 10.0)  # committed
    run = CliRunner().invoke
    r = run(app, ["budgets", "set", "ml", "--cap", "50", "--alert", "0.9", "--config", cfg, "--json"])
    assert r.exit_code == 0, r.output
    b = json.loads(r.output)
    # 40 spent + 10 committed = the 50 USD cap: remaining 0, capped; 50 >= 0.9 x 50: alert
    assert (b["spent_usd"], b["committed_usd"], b["remaining_usd"], b["capped"], b["alert"]) == (40.0, 10.0, 0.0,
                                                                                               True, True)
    r = run(app, ["budgets", "list", "--config", cfg])
    assert r.exit_code == 0 and "ml" in r.output and "CAPPED: no new cloud spend" in r.output, r.output
    r = run(app, ["budgets", "show", "ml", "--config", cfg, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["cap_usd"] == 50.0
    r = run(app, ["budgets", "set", "ml", "--cap", "-5", "--config", cfg])
    assert r.exit_code == 2 and "--cap=-5.0" in r.output
    r = run(app, ["budgets", "set", "ml", "--cap", "5", "--alert", "0", "--config", cfg])
    assert r.exit_code == 2 and "--alert=0.0" in r.output
    r = run(app, ["budgets", "show", "vision", "--config", cfg])
    assert r.exit_code == 1 and "no budget" in r.output
    # the walk-through: --cap 1e308 was accepted and printed as a 60-digit number; a typo'd team without a word
    r = run(app, ["budgets", "set", "ml", "--cap", "1e308", "--config", cfg])
    assert r.exit_code == 2 and "--cap=1e+308: above the largest cap, 1e+12 USD a month" in " ".join(r.output.split())
    r = run(app, ["budgets", "set", "nosuchteam", "--cap", "100", "--config", cfg])
    assert r.exit_code == 2, r.output
    assert ("team='nosuchteam': no token, job or budget of this team: a typo? (to budget a team before its first "
            "token: fedbroker budgets set --new-team)") in " ".join(r.output.split())
    r = run(app, ["budgets", "set", "nosuchteam", "--cap", "100", "--new-team", "--config", cfg, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["cap_usd"] == 100.0
    assert run(app, ["budgets", "delete", "nosuchteam", "--config", cfg]).exit_code == 0
    assert run(app, ["budgets", "delete", "ml", "--config", cfg]).exit_code == 0
    assert run(app, ["budgets", "delete", "ml", "--config", cfg]).exit_code == 1
    r = run(app, ["budgets", "list", "--config", cfg])
    assert r.exit_code == 0 and "no budgets" in r.output


def test_project_budget_set_list_show_delete(pg_store, tmp_path):
    from tests.broker.service.test_project_budgets import _place_cloud_project

    cfg = _cfg(pg_store, tmp_path)
    month0, _ = month_bounds(utcnow())
    with pg_store.session() as s:  # 30 USD spent by project a this month, 7 by the team's project b
        usage.add_usage(s, [_line("job-a", "ml", month0, 30.0, project="a"),
                            _line("job-b", "ml", month0, 7.0, project="b")], month0)
    _place_cloud_project(pg_store, "ml", "a", 5.0)  # committed to project a
    run = CliRunner().invoke
    r = run(app, ["budgets", "set", "ml", "--project", "a", "--cap", "50", "--config", cfg, "--json"])
    assert r.exit_code == 0, r.output
    b = json.loads(r.output)
    # project a: 30 spent + 5 committed of 50: remaining 15; 35 < 0.8 x 50 = 40: no alert
    assert (b["team"], b["project"], b["spent_usd"], b["committed_usd"], b["remaining_usd"], b["capped"],
            b["alert"]) == ("ml", "a", 30.0, 5.0, 15.0, False, False)
    r = run(app, ["budgets", "list", "--config", cfg])  # the team budgets: none
    assert r.exit_code == 0 and "no budgets" in r.output, r.output
    r = run(app, ["budgets", "list", "--projects", "--config", cfg])
    assert r.exit_code == 0 and "project" in r.output and "15.00" in r.output, r.output
    r = run(app, ["budgets", "show", "ml", "--project", "a", "--config", cfg, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["remaining_usd"] == 15.0
    r = run(app, ["budgets", "show", "ml", "--project", "b", "--config", cfg])
    assert r.exit_code == 1 and "project 'b' of team 'ml' has no budget" in r.output
    r = run(app, ["budgets", "set", "ml", "--project", "no spaces", "--cap", "5", "--config", cfg])
    assert r.exit_code == 2 and "--project='no spaces'" in r.output
    assert run(app, ["budgets", "delete", "ml", "--project", "a", "--config", cfg]).exit_code == 0
    assert run(app, ["budgets", "delete", "ml", "--project", "a", "--config", cfg]).exit_code == 1
