"""The node agent's nftables table (workers.network_guard) and the endpoints the API serves it
(broker.service.service_endpoints, ``GET /v1/node/config``), issue 20 finding #2."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from broker.service.service_endpoints import ServiceEndpoint, service_endpoints
from broker.service.settings import BrokerSettings
from workers.network_guard import NetworkGuard, NetworkGuardError, table_name


def test_endpoints_of_the_brokers_urls():
    st = BrokerSettings(redis_url="redis://:s3cret@10.0.0.5:6390/0",
                        database_url="postgresql+psycopg://fb@db.internal/fedbroker",
                        jobs={"blocked_endpoints": ["[fd00::7]:9000", "metrics.internal:8086"]})
    assert service_endpoints(st) == [
        ServiceEndpoint("redis_url", "redis", host="10.0.0.5", port=6390, password=True),
        ServiceEndpoint("database_url", "postgresql", host="db.internal", port=5432, password=False),
        ServiceEndpoint("jobs.blocked_endpoints[0]", "tcp", host="fd00::7", port=9000),
        ServiceEndpoint("jobs.blocked_endpoints[1]", "tcp", host="metrics.internal", port=8086),
    ]
    # the quick start's: password-less Redis on 127.0.0.1, the embedded SQLite file (no endpoint)
    assert service_endpoints(BrokerSettings()) == [ServiceEndpoint("redis_url", "redis", host="127.0.0.1", port=6379)]
    # UNIX sockets: a Redis socket, PostgreSQL through libpq's default directory or ?host=
    st = BrokerSettings(redis_url="unix:///run/redis/redis.sock?db=2&password=x",
                        database_url="postgresql+psycopg:///fedbroker?host=/srv/pg")
    assert service_endpoints(st) == [ServiceEndpoint("redis_url", "redis", socket="/run/redis/redis.sock", password=True),
                                     ServiceEndpoint("database_url", "postgresql", socket="/srv/pg")]
    st = BrokerSettings(database_url="postgresql:///fedbroker")
    assert service_endpoints(st)[1] == ServiceEndpoint("database_url", "postgresql", socket="/var/run/postgresql")


@pytest.mark.parametrize("value", ["redis", "host:", ":6379", "host:0", "host:65536", "host:x"])
def test_blocked_endpoints_setting_names_the_bad_item(value):
    with pytest.raises(ValueError, match=rf"jobs\.blocked_endpoints\[0\]={value!r}: expected host:port"):
        BrokerSettings(jobs={"blocked_endpoints": [value]})


def test_table_name_is_an_nft_identifier():
    assert table_name("n1") == "fedbroker_agent_n1"
    assert table_name("gpu-07.rack2") == "fedbroker_agent_gpu_07_rack2_" + __import__("hashlib").sha256(
        b"gpu-07.rack2").hexdigest()[:8]
    assert table_name("n1", "{ 61184-65519 } 127.0.0.1:6379") == "fedbroker_agent_n1_" + __import__(
        "hashlib").sha256(b"{ 61184-65519 } 127.0.0.1:6379").hexdigest()[:8]


def test_ruleset_blocks_local_ports_and_remote_addresses_for_the_job_uids():
    eps = [{"setting": "redis_url", "host": "127.0.0.1", "port": 6379},
           {"setting": "database_url", "host": "10.0.0.9", "port": 5432},
           {"setting": "jobs.blocked_endpoints[0]", "host": "fd00::7", "port": 5432},
           {"setting": "database_url", "host": None, "port": None, "socket": "/var/run/postgresql"}]
    g = NetworkGuard("n1", [(61184, 65519), (1, 1)], eps)
    who = "meta skuid { 1, 61184-65519 }"
    assert g.guards == "{ 1, 61184-65519 } 10.0.0.9:5432,127.0.0.1:6379,fd00::7:5432"
    t = table_name("n1", g.guards)
    assert g.ruleset() == (
        f"table inet {t}\ndelete table inet {t}\n"
        f"table inet {t} {{\n  chain output {{\n"
        "    type filter hook output priority filter; policy accept;\n"
        f"    {who} tcp dport {{ 5432, 6379 }} fib daddr type local counter reject with tcp reset\n"
        f"    {who} ip daddr {{ 10.0.0.9 }} tcp dport 5432 counter reject with tcp reset\n"
        f"    {who} ip6 daddr {{ fd00::7 }} tcp dport 5432 counter reject with tcp reset\n"
        "  }\n}\n")


def test_no_nft_is_a_clear_error(tmp_path):
    g = NetworkGuard("n1", [(61184, 65519)], [], nft=str(tmp_path / "no-nft"))
    with pytest.raises(NetworkGuardError, match=r"is not installed.*apt-get install nftables"):
        g.install()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_install_is_idempotent_and_remove_deletes_the_table():
    g = NetworkGuard("guard-test", [(59990, 59999)], [{"setting": "redis_url", "host": "127.0.0.1", "port": 6379}])
    try:
        g.install()
        g.install()  # an agent started again over its old table: one table, one rule
        listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        assert listed.count(f"table inet {g.table}\n") == 1
        assert g.installed().count("reject with tcp reset") == 1
        refused = subprocess.run(["setpriv", "--reuid", "59995", "--regid", "59995", "--clear-groups",
                                  "redis-cli", "-h", "127.0.0.1", "ping"], capture_output=True, text=True)
        assert "Connection refused" in refused.stdout + refused.stderr
        other = subprocess.run(["setpriv", "--reuid", "59989", "--regid", "59989", "--clear-groups",
                                "redis-cli", "-h", "127.0.0.1", "ping"], capture_output=True, text=True)
        assert other.stdout == "PONG\n"  # a uid outside the range is not matched
    finally:
        g.remove()
    assert g.installed() is None
    g.remove()  # nothing to do


def test_the_node_config_serves_the_endpoints_to_block(pg_store, rig):
    r = rig({"n1": 1})
    r.settings.jobs.blocked_endpoints = ["metrics.internal:8086"]
    assert r.agents["n1"].api.config()["blocked_endpoints"] == [
        {"setting": "redis_url", "kind": "redis", "host": "127.0.0.1", "port": 6379, "socket": None, "password": False},
        {"setting": "database_url", "kind": "postgresql", "host": "127.0.0.1", "port": 5432, "socket": None,
         "password": False},
        {"setting": "jobs.blocked_endpoints[0]", "kind": "tcp", "host": "metrics.internal", "port": 8086,
         "socket": None, "password": False},
    ]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_the_agents_table_stays_while_a_job_runs_and_goes_when_it_stops_idle(pg_store, rig):
    from tests.workers.rig import sh

    r = rig({"n1": 1})
    agent = r.agents["n1"]
    agent.prepare()  # what the first supervision step does (serve agent: before it starts)
    assert agent.guard.installed() is not None
    jid = pg_store.submit("ml", sh("sleep 30"))[0].id
    r.until(lambda: r.state(jid) == "running", what="the job to run")
    agent.stop()
    assert agent.guard.installed() is not None  # its job still runs: its rules stay
    fresh = r.new_agent("n1")  # started again: replaces the table, re-adopts the job
    r.agents["n1"] = fresh
    fresh.prepare()
    assert fresh.guard.installed().count("fib daddr type local") == 1
    pg_store.request_cancel(jid, "ml")
    r.until(lambda: r.state(jid) == "cancelled", what="the cancel")
    fresh.stop()
    assert fresh.guard.installed() is None  # nothing runs: the table is gone


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_two_brokers_agents_under_one_node_name_keep_their_own_tables():
    """A hostile review ran a second broker's quick start on a host whose first broker named its node the same:
    the second agent replaced the first's table and deleted it on stop, and the first broker's jobs reached its
    PostgreSQL. Each table is named after what it guards: the second one stopping leaves the first in place."""
    first = NetworkGuard("guard-twin", [(59970, 59979)], [{"setting": "redis_url", "host": "127.0.0.1", "port": 6391}])
    second = NetworkGuard("guard-twin", [(59980, 59989)], [{"setting": "redis_url", "host": "127.0.0.1", "port": 6392}])
    try:
        first.install()
        second.install()
        assert first.table != second.table
        second.remove()
        assert second.installed() is None
        assert "meta skuid 59970-59979 tcp dport 6391 " in (first.installed() or "")
    finally:
        first.remove()
        second.remove()
