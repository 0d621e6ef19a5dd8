"""Job output must not fill the database (issue #20 item 3, finding #4 of 2026-12-04): the store keeps each attempt
rank's log within ``log_max_bytes`` (head and tail, a marker between) and every team's logs within its
``quotas.log_bytes``, trimming the team's oldest logs first. Real PostgreSQL (and SQLite for the cap).

Hand-checked figures: chunks of 1,000 ASCII bytes; ``dropped_marker(n)`` is 37 bytes + the digits of ``n``
(``"\\n[fedbroker: ... 3000 bytes dropped ...]\\n"``: 41 bytes).
"""

from __future__ import annotations

import string
import uuid
import warnings
import pytest

with warnings.catch_warnings():  # starlette's TestClient warns about httpx on import
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from broker.log_marker import dropped_bytes, dropped_marker
from broker.model import JobSpec
from broker.service.api import create_app
from broker.service.log_budget import enforce_log_budgets
from broker.service.reconciler import Reconciler
from broker.service.settings import BrokerSettings, QuotaSettings, TeamQuota
from broker.service.store import logs as logs_repo
from broker.service.tokens import create_token
from tests.conftest import auth

RUN = JobSpec(command=["/bin/true"], estimated_duration_s=60)
M = {n: dropped_marker(n) for n in (2000, 3000, 4000, 5000)}


def chunk(i: int) -> str:
    return string.ascii_lowercase[i] * 1000


def job_with_log(store, team: str, chunks: int) -> str:
    jid = store.submit(team, RUN)[0].id
    for i in range(chunks):
        assert store.append_log(jid, 1, 0, i, chunk(i))
    return jid


def text(store, jid: str) -> str:
    return "".join(d for _, d in store.log_chunks(jid, 1, 0))


def stored(store, team: str) -> int:
    with store.session() as s:
        return logs_repo.team_log_bytes(s).get(team, 0)


def test_marker_is_41_bytes_for_3000():
    assert M[3000] == "\n[fedbroker: ... 3000 bytes dropped ...]\n" and len(M[3000].encode()) == 41
    assert dropped_bytes("x" + M[3000] + "y" + M[2000]) == 5000 and dropped_bytes("no marker") == 0


# ----------------------------------------------------------------------------- the per-attempt cap
def test_the_store_keeps_head_and_tail_of_a_log_over_log_max_bytes(any_store):
    """max_bytes 4096: head <= 4096 - 2048 - 64 = 1984 bytes (one chunk), tail <= 2048 (two chunks)."""
    st = any_store
    jid = st.submit("ml", RUN)[0].id
    for i in range(5):  # 5,000 bytes > 4,096 at the 5th chunk: b and c are dropped
        assert st.append_log(jid, 1, 0, i, chunk(i), max_bytes=4096)
    assert text(st, jid) == chunk(0) + M[2000] + chunk(3) + chunk(4)
    assert st.append_log(jid, 1, 0, 5, chunk(5), max_bytes=4096)  # 1,000 + 41 + 3,000 = 4,041: kept whole
    assert text(st, jid) == chunk(0) + M[2000] + chunk(3) + chunk(4) + chunk(5)
    assert st.append_log(jid, 1, 0, 6, chunk(6), max_bytes=4096)  # over again: d and e join the dropped bytes
    assert text(st, jid) == chunk(0) + M[4000] + chunk(5) + chunk(6)
    with st.session() as s:
        assert logs_repo.log_bytes(s, jid, 1, 0) == 3000 + 41
    assert not st.append_log(jid, 1, 0, 6, chunk(6), max_bytes=4096)  # a replayed chunk is still ignored


def test_node_log_upload_is_capped_and_the_api_reports_truncated(pg_store):
    from broker.service.cycle import PlanningCycle
    from broker.service.live import LiveEnvironment
    from broker.service.tokens import create_node_token

    st = BrokerSettings(log_max_bytes=4096)
    node = {"Authorization": f"Bearer {create_node_token(pg_store, 'n1')}"}
    member = auth(create_token(pg_store, "ml", "member", label="t").token)
    with TestClient(create_app(pg_store, st)) as c:
        hb = {"pool": "local", "gpu_type": "V100", "gpu_count": 1, "gpu_memory_gb": 16.0, "healthy_gpus": [0],
              "agent_id": "a", "telemetry": None}
        assert c.post("/v1/node/heartbeat", json=hb, headers=node).status_code == 200
        jid = pg_store.submit("ml", RUN)[0].id
        PlanningCycle(pg_store, LiveEnvironment(st.planner), st).run()
        assert pg_store.get(jid).state == "starting"
        for i in range(5):
            r = c.post(f"/v1/node/attempts/{jid}/1/0/logs", json={"seq": i, "text": chunk(i)}, headers=node)
            assert r.status_code == 200 and r.json() == {"stored": True}, r.text
        got = c.get(f"/v1/jobs/{jid}/logs", headers=member).json()
    assert got["text"] == chunk(0) + M[2000] + chunk(3) + chunk(4) and got["truncated"] is True


# ----------------------------------------------------------------------------- the team budget
def test_team_over_its_log_budget_has_its_oldest_logs_trimmed_first(pg_store):
    team, other = "t" + uuid.uuid4().hex[:8], "o" + uuid.uuid4().hex[:8]
    jobs = [job_with_log(pg_store, team, 5) for _ in range(3)]  # 3 x 5,000 = 15,000 bytes
    big = job_with_log(pg_store, other, 5)  # another team, within its (default) budget: never touched
    quotas = QuotaSettings(per_team={team: TeamQuota(log_bytes=10_000)})

    got = enforce_log_budgets(pg_store, quotas, keep_bytes=1000)
    # the oldest log: head a, tail e, 3,000 bytes dropped (freed 3,000 - 41 = 2,959): 12,041 > 10,000, so the
    # second one too: 9,082 <= 10,000, and the newest is kept whole
    assert got == {"teams_over": 1, "logs_trimmed": 2, "bytes_freed": 2 * 2959}
    assert [text(pg_store, j) for j in jobs] == [chunk(0) + M[3000] + chunk(4)] * 2 + [
        "".join(chunk(i) for i in range(5))]
    assert stored(pg_store, team) == 9082
    assert text(pg_store, big) == "".join(chunk(i) for i in range(5)) and stored(pg_store, other) == 5000
    # within budget now: a second pass changes nothing
    assert enforce_log_budgets(pg_store, quotas, keep_bytes=1000) == {"teams_over": 0, "logs_trimmed": 0,
                                                                      "bytes_freed": 0}

    # a budget of 3,000: every log to head + tail (3 x 2,041 = 6,123), then the oldest to its marker alone
    quotas = QuotaSettings(per_team={team: TeamQuota(log_bytes=3000)})
    got = enforce_log_budgets(pg_store, quotas, keep_bytes=1000)
    assert got == {"teams_over": 1, "logs_trimmed": 3, "bytes_freed": 2959 + 2 * (2041 - 41)}
    assert [text(pg_store, j) for j in jobs] == [M[5000], M[5000], chunk(0) + M[3000] + chunk(4)]
    assert stored(pg_store, team) == 41 + 41 + 2041


def test_reconciler_pass_enforces_the_budget(pg_store):
    team = "t" + uuid.uuid4().hex[:8]
    old, new = job_with_log(pg_store, team, 5), job_with_log(pg_store, team, 5)
    st = BrokerSettings(log_trim_keep_bytes=1000, quotas=QuotaSettings(per_team={team: TeamQuota(log_bytes=8000)}))
    out = Reconciler(pg_store, st).run()
    assert out["log_budget"] == {"teams_over": 1, "logs_trimmed": 1, "bytes_freed": 2959}
    assert text(pg_store, old) == chunk(0) + M[3000] + chunk(4) and stored(pg_store, team) == 7041
    assert text(pg_store, new) == "".join(chunk(i) for i in range(5))


def test_default_team_log_budget_is_1_gib():
    assert BrokerSettings().quotas.for_team("anyone").log_bytes == 1024 ** 3
    assert BrokerSettings().log_trim_keep_bytes == 64 * 1024
