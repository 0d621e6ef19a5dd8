"""Shared fixtures: real PostgreSQL and Redis on 127.0.0.1 (started by .ci/run), SQLite in tmp dirs.

``FEDBROKER_TEST_PG`` overrides the PostgreSQL URL (default: database ``test``, trust auth);
``FEDBROKER_TEST_REDIS`` the Redis URL (default db 15, flushed by the tests that use it).
"""

from __future__ import annotations

import os
import uuid

import pytest

PG_URL = os.environ.get("FEDBROKER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("FEDBROKER_TEST_REDIS", "redis://127.0.0.1:6379/15")


@pytest.fixture
def pg_store():
    """A :class:`JobStore` on a fresh PostgreSQL schema, dropped afterwards."""
    from broker.service.store.core import JobStore

    store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    yield store
    store.drop_schema()


@pytest.fixture(scope="module")
def module_pg_store():
    """A :class:`JobStore` on a fresh PostgreSQL schema shared by one test module."""
    from broker.service.store.core import JobStore

    store = JobStore(PG_URL, schema=f"t_{uuid.uuid4().hex[:12]}")
    store.migrate()
    yield store
    store.drop_schema()


@pytest.fixture
def sqlite_store(tmp_path):
    """A :class:`JobStore` on an SQLite file in ``tmp_path``."""
    from broker.service.store.core import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'fedbroker.db'}")
    store.migrate()
    yield store
    store.engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_store(request):
    """The same test on PostgreSQL and on SQLite."""
    yield request.getfixturevalue("pg_store" if request.param == "postgresql" else "sqlite_store")


def auth(token: str) -> dict:
    """HTTP headers carrying an API token."""
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def make_team(store):
    """``make_team(admin=False) -> (team, auth headers)`` for a fresh team with one token in the
    test module's ``store``."""

    from broker.service.tokens import create_token

    def make(admin: bool = False):
        team = "t" + uuid.uuid4().hex[:10]
        return team, auth(create_token(store, team, "admin" if admin else "member", label="test").token)

    return make


# ----------------------------------------------------------------------------- AWS on a moto server

AWS_TEST_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SECURITY_TOKEN": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def aws_env():
    """Fake AWS credentials in the environment for the whole run (moto accepts any; nothing reaches AWS)."""
    old = {k: os.environ.get(k) for k in AWS_TEST_KEYS}
    os.environ.update(AWS_TEST_KEYS)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server(aws_env):
    """One moto server (real HTTP EC2/Service Quotas API) for the run; its URL. Tests keep apart by using
    their own broker id (the ``fedbroker-broker`` tag): resetting moto costs ~1.5 s a test."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()

