"""``fedbroker cost report`` and ``fedbroker cost export --focus`` through a threaded API server (PostgreSQL),
over the hand-worked ledger of ``tests/broker/service/test_usage_api.py``."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from broker.cli import console as cli_console
from broker.cli import main as cli
from broker.service.api import create_app
from broker.service.settings import BrokerSettings, FinanceSettings
from broker.service.store import usage
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread
from tests.broker.service.test_usage_api import ORG, SPEC_MANDATORY, ledger, rec

ADMIN = "admin-" + uuid.uuid4().hex
MARCH = ["--from", "2024-03-01", "--to", "2024-04-01"]


@pytest.fixture(scope="module")
def world(module_pg_store):
    alpha, beta = "alpha" + uuid.uuid4().hex[:6], "beta" + uuid.uuid4().hex[:6]
    with module_pg_store.session() as s:
        usage.add_usage(s, ledger(alpha, beta), datetime(2024, 4, 2, tzinfo=timezone.utc))
    app = create_app(module_pg_store, BrokerSettings(admin_token=ADMIN, finance=FinanceSettings(organisation=ORG)))
    with ServerThread(app) as srv:
        yield {"url": srv.url, "alpha": alpha, "beta": beta, "tokens": {
            "admin": ADMIN, "alpha": create_token(module_pg_store, alpha, label="t").token}}


@pytest.fixture
def run(monkeypatch, world):
    monkeypatch.setattr(cli_console, "console", Console(width=300, force_terminal=False, color_system=None))

    def invoke(*args, who: str = "admin"):
        return CliRunner().invoke(cli.app, list(args), env={
            "FEDBROKER_API_URL": world["url"], "FEDBROKER_TOKEN": world["tokens"][who], "FEDBROKER_CONFIG": None})

    return invoke


def cells(output: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in output.splitlines():
        parts = [p.strip() for p in line.strip().strip("│┃|").split("│")]
        if parts and parts[0] == first:
            return parts
    raise AssertionError(f"no row {first!r} in:\n{output}")


def test_report_by_provider_prints_the_hand_worked_table(run):
    r = run("cost", "report", *MARCH, "--by", "provider")
    assert r.exit_code == 0, r.output
    # columns: key, cost USD, GPU-hours, kWh, kgCO2e, lines, estimated, unpriced
    assert cells(r.stdout, "gcp") == ["gcp", "10.00", "4.00", "2.00", "0.500", "1", "1", "0"]
    assert cells(r.stdout, "onprem") == ["onprem", "6.60", "5.00", "3.00", "0.600", "3", "1", "1"]
    # kgCO2e: 3 decimals, so its smallest figure (0.04) keeps 2 significant digits (broker.money)
    assert cells(r.stdout, "aws") == ["aws", "0.60", "0.10", "0.10", "0.040", "1", "1", "0"]
    assert cells(r.stdout, "total") == ["total", "17.20", "9.10", "5.10", "1.140", "5", "3", "1"]
    assert "1 line(s) without a known cost" in r.output  # the note (stderr)


def test_report_json_and_team_scope(run, world):
    r = run("cost", "report", *MARCH, "--by", "day", "--json", who="alpha")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["team"] == world["alpha"] and out["by"] == "day"
    assert [(g["key"], round(g["cost_usd"], 9)) for g in out["groups"]] == [("2024-03-01", 0.6), ("2024-03-02", 10.0)]
    r = run("cost", "report", *MARCH, "--team", world["beta"], who="alpha")
    assert r.exit_code == 1 and world["beta"] in r.output  # 403 from the broker


def test_small_teams_figures_keep_two_significant_digits_and_the_visible_total_adds_up(run, world, module_pg_store):
    # the walk-through's report by pool: hpc 0.01 + local 0.03 = total 0.03 when rounded to cents
    team = "small" + uuid.uuid4().hex[:6]
    t = datetime(2024, 6, 3, 10, tzinfo=timezone.utc)
    onprem = dict(provider="onprem", region="GB", line="energy", pricing_unit="kWh", gpu_count=1, carbon_kg=0.0)
    lines = [rec(40, team, t, 60, pool="hpc", resource="slurm:1", list_unit_price_usd=0.25, billed_usd=0.0125,
                 energy_kwh=0.05, **onprem),
             rec(41, team, t, 60, pool="local", resource="node-1", list_unit_price_usd=0.25, billed_usd=0.0287,
                 energy_kwh=0.1148, **onprem)]
    with module_pg_store.session() as s:
        usage.add_usage(s, lines, datetime(2024, 6, 4, tzinfo=timezone.utc))
    r = run("cost", "report", "--from", "2024-06-01", "--to", "2024-07-01", "--by", "pool", "--team", team)
    assert r.exit_code == 0, r.output
    # cost USD 0.013 + 0.029 = 0.041 (0.0125 rounds half up); kWh 0.050 + 0.115 = 0.165; GPU-h 1/60 = 0.017
    assert cells(r.stdout, "hpc")[:5] == ["hpc", "0.013", "0.017", "0.050", "0.00"]
    assert cells(r.stdout, "local")[:5] == ["local", "0.029", "0.017", "0.115", "0.00"]
    assert cells(r.stdout, "total")[:5] == ["total", "0.041", "0.033", "0.165", "0.00"]


def test_report_and_export_default_to_this_month_utc(run, world, module_pg_store, tmp_path):
    team = "now" + uuid.uuid4().hex[:6]
    now = datetime.now(timezone.utc)
    first = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    nxt = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=timezone.utc)
    with module_pg_store.session() as s:
        usage.add_usage(s, [rec(50, team, first, 60, provider="aws", region="us-east-1", gpu_count=1,
                                list_unit_price_usd=3.0, billed_usd=0.05, energy_kwh=0.01, carbon_kg=0.004)], now)
    r = run("cost", "report", "--team", team, "--json")  # no --from/--to (cb5ea98: exit 2, "Missing option")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["start"], out["end"]) == (first.isoformat().replace("+00:00", "Z"), nxt.isoformat().replace("+00:00", "Z"))
    assert [(g["key"], g["cost_usd"]) for g in out["groups"]] == [(team, 0.05)]
    f = tmp_path / "month.csv"
    r = run("cost", "export", "--focus", str(f), "--team", team)
    assert r.exit_code == 0, r.output
    assert list(pd.read_csv(f)["BilledCost"]) == [0.05]


@pytest.mark.parametrize("args,needle", [
    (["--by", "week", *MARCH], "--by='week'"),
    (["--from", "2024-04-01", "--to", "2024-03-01"], "--to='2024-03-01': not after --from='2024-04-01'"),
    (["--from", "March", "--to", "2024-03-01"], "--from='March'"),
])
def test_report_bad_options_exit_2(run, args, needle):
    r = run("cost", "report", *args)
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output


def test_export_writes_a_focus_csv(run, world, tmp_path):
    f = tmp_path / "march.csv"
    r = run("cost", "export", "--focus", str(f), *MARCH)
    assert r.exit_code == 0, r.output
    assert "wrote 4 FOCUS 1.2 row(s)" in r.output and "1 ledger line(s) without a known cost" in r.output
    df = pd.read_csv(f)
    assert len(df) == 4 and set(SPEC_MANDATORY) <= set(df.columns)
    assert df["BilledCost"].sum() == pytest.approx(17.2)
    assert set(df.loc[df["x_UsageLine"] != "instance", "InvoiceIssuerName"]) == {ORG}
    # a team token exports its own team's lines only
    r = run("cost", "export", "--focus", str(f), *MARCH, who="alpha")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(f)
    assert len(df) == 2 and {json.loads(t)["team"] for t in df["Tags"]} == {world["alpha"]}


def test_export_to_a_missing_directory_exits_2(run, tmp_path):
    r = run("cost", "export", "--focus", str(tmp_path / "no" / "such.csv"), *MARCH)
    assert r.exit_code == 2 and "no such directory" in r.output
