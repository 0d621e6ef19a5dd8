"""``fedbroker nodes list`` as a member (issue #20 item 4): the free capacity per pool and GPU type, never another
team's view of each GPU (cb5ea98's member saw every node's name and GPUs); an admin still sees each node."""

from __future__ import annotations

import uuid

import pytest
from rich.console import Console
from typer.testing import CliRunner

from broker.cli import console as cli_console
from broker.cli import main as cli
from broker.service.api import create_app
from broker.service.settings import BrokerSettings
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread

ADMIN = "admin-" + uuid.uuid4().hex


@pytest.fixture
def world(pg_store, monkeypatch):
    monkeypatch.setattr(cli_console, "console", Console(width=200, force_terminal=False, color_system=None))
    pool = "p" + uuid.uuid4().hex[:8]
    pg_store.heartbeat(f"{pool}-a", pool, "V100", 4, 32.0, [0, 1, 3], "agent-a", telemetry={"gpu_util": [0.7] * 4})
    with ServerThread(create_app(pg_store, BrokerSettings(admin_token=ADMIN))) as srv:
        yield {"url": srv.url, "pool": pool, "member": create_token(pg_store, "vision").token}


def run(world, *args, token: str):
    return CliRunner().invoke(cli.app, list(args), env={"FEDBROKER_API_URL": world["url"], "FEDBROKER_TOKEN": token,
                                                       "FEDBROKER_CONFIG": None})


def test_a_member_lists_capacity_and_an_admin_each_node(world):
    pool = world["pool"]
    r = run(world, "nodes", "list", token=world["member"])
    assert r.exit_code == 0, r.output
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in r.stdout.splitlines() if pool in line]
    assert rows == [[pool, "V100", "1/1", "4", "3", "3"]]  # pool, GPU type, nodes up, GPUs, healthy, free
    assert f"{pool}-a" not in r.stdout and "(admin tokens see each node)" in " ".join(r.stdout.split())
    r = run(world, "nodes", "list", token=ADMIN)
    assert r.exit_code == 0 and f"{pool}-a" in r.stdout, r.output
