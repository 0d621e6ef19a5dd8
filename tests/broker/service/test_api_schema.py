"""schemathesis over every operation of the API's own OpenAPI schema (issue #9, item 9).

The app runs in-process (ASGI) over a fresh PostgreSQL schema. Every generated request is sent
three times: with a valid token of team A, with no token, and with the token of another team (B).
Each answer must be no server error (5xx) and conform to the schema (status code declared for the
operation, content type, body and headers matching the declared response schema); schema-invalid
requests must be refused with a 4xx (``negative_data_rejection``).

The node API (``/v1/node/...``) is called with a node's own token, no token, a team's token and
another node's token instead.

Path ids: half of the generated ``job_id``/``schedule_id`` values are replaced by a real job or
schedule of team A, so the valid token reads it and the foreign token gets 404 for something that
exists (not just for a random id).

``POST /v1/instances/report`` (a form body) is driven through a stand-in cloud broker that takes
team A's token as the report token, so the form checks run; signed report tokens and replays against
the real :class:`broker.service.cloud.CloudBroker` are in ``test_cloud.py`` and ``test_instance_report_api.py``.

Bounded for CI: ``MAX_EXAMPLES`` per operation and phase; the whole module runs in about a minute.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from broker.service.api import create_app
from broker.service.cloud import REPORT_EVENTS, ReportError
from broker.model import JobSpec
from broker.service.settings import BrokerSettings
from broker.service.tokens import create_node_token, create_token

#: examples per operation and phase (38 operations x 3 or 4 callers)
MAX_EXAMPLES = 30
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]


class _StandInCloud:
    """Takes ``token`` as every rank's report token; answers reports as CloudBroker does for a known rank."""

    def __init__(self, token: str):
        self.token_ = token

    def check_token(self, job_id: str, attempt: int, rank: int, token: str) -> bool:
        return token == self.token_

    def report(self, job_id, attempt, rank, event, exit_code=None, reason="", log_tail="", seq=None):
        if event not in REPORT_EVENTS:
            raise ReportError(422, f"event={event!r}: must be one of {', '.join(REPORT_EVENTS)}")
        return "running" if event == "running" else "ok"


@pytest.fixture(scope="module")
def world(module_pg_store):
    """The app over a fresh store, with team A's job and schedule and the tokens of teams A and B."""
    store = module_pg_store
    team_a, team_b = "a" + uuid.uuid4().hex[:8], "b" + uuid.uuid4().hex[:8]
    tok_a = create_token(store, team_a, label="schemathesis").token
    tok_b = create_token(store, team_b, label="schemathesis").token
    now = datetime.now(timezone.utc)
    spec = JobSpec(command=["python", "train.py"], deadline=now + timedelta(days=2))
    job, _ = store.submit(team_a, spec, now=now)
    sched = store.create_schedule(team_a, "nightly", "0 2 * * *", "UTC",
                                  JobSpec(command=["python", "train.py"], slack_s=3600), now=now)
    node_a, node_b = create_node_token(store, "n-a"), create_node_token(store, "n-b")
    app = create_app(store, BrokerSettings(admin_token="admin-" + uuid.uuid4().hex), cloud=_StandInCloud(tok_a))
    return {"app": app, "job_id": job.id, "schedule_id": sched.id,
            "tokens": {"valid": tok_a, "missing": None, "foreign": tok_b},
            # the node API (/v1/node/...): a node's own token, none, and a team's token
            "node_tokens": {"valid": node_a, "missing": None, "foreign": tok_a, "other node": node_b}}


@pytest.fixture(scope="module")
def api_schema(world):
    return schemathesis.openapi.from_asgi("/openapi.json", world["app"])


#: every operation of the schema, as (METHOD, path); the app's schema needs no store to be built
_PATHS = create_app(None).openapi()["paths"]
OPERATIONS = [(m.upper(), p) for p, ops in _PATHS.items() for m in ops]
#: (method, path, mode): negative cases only where the operation declares something to break
#: (``GET /healthz`` declares no parameters or body)
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or {"parameters", "requestBody"} & set(_PATHS[p][m.lower()])]


def test_every_operation_is_covered():
    # a new operation changes this count: it is then covered by the cases below, with the right tokens
    assert len(OPERATIONS) == 38 and ("POST", "/v1/jobs") in OPERATIONS and ("GET", "/healthz") in OPERATIONS and ("GET", "/metrics") in OPERATIONS
    assert sum(p.startswith("/v1/node/") for _, p in OPERATIONS) == 8


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_operation_with_valid_missing_and_foreign_tokens(api_schema, world, method, path, mode):
    """0 server errors and 0 schema violations for each of the three callers."""
    op = api_schema[path][method]
    # the bulk submit answers 200 with a result per item, a schema-invalid item getting its own 422 (a bad
    # item must not reject the others): its invalid items are checked in test_limits.py, not refused here
    checks = [c for c in CHECKS if not (path == "/v1/jobs:batch" and c is negative_data_rejection)]

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        ids = case.path_parameters or {}
        for name in ("job_id", "schedule_id"):
            if name in ids and len(str(ids[name])) % 2 == 0:
                ids[name] = world[name]
        generated = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        callers = world["node_tokens" if path.startswith("/v1/node/") else "tokens"]
        for who, token in callers.items():
            case.headers = dict(generated, **({"Authorization": f"Bearer {token}"} if token else {}))
            try:
                case.call_and_validate(checks=checks)
            except Exception as e:  # name the caller in the failure
                raise AssertionError(f"{method} {path}, {who} token: {e}") from e

    run()
