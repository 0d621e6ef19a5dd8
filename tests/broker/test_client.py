"""The SDK (broker.Client) against a real uvicorn server in a background thread
(:class:`tests.broker.harness.ServerThread`), on PostgreSQL."""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

import broker
from broker.service.api import create_app
from broker.client import (AuthError, BrokerError, BrokerUnavailable, Client, Conflict, InvalidId, NotFound,
                           ValidationFailed, WaitTimeout)
from broker.model import JobSpec
from broker.service.settings import BrokerSettings
from broker.service.store.core import JobStore
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread, count_jobs

ADMIN = "admin-secret-" + uuid.uuid4().hex
UTC = timezone.utc


def _read_http_message(conn: socket.socket) -> bytes:
    """One HTTP/1.1 message with a Content-Length body (what requests and uvicorn send here)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return buf
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class DropFirstResponseProxy:
    """A TCP proxy to ``target_port`` that loses the first answer.

    The first accepted connection: read the whole request, forward it to the API, read the
    API's whole answer (so the job exists), then close the client's connection without
    sending anything back. Later connections are piped both ways.
    ``requests`` holds the request line of every connection; ``dropped`` the lost answer.
    """

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.dropped: bytes | None = None
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self.listener.close()

    def _accept(self) -> None:
        n = 0
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, n), daemon=True).start()
            n += 1

    def _handle(self, conn: socket.socket, n: int) -> None:
        up = socket.create_connection(self.target)
        try:
            if n == 0:
                req = _read_http_message(conn)
                self.requests.append(req.split(b"\r\n", 1)[0])
                up.sendall(req)
                self.dropped = _read_http_message(up)
                return  # close without answering
            first = conn.recv(65536)
            self.requests.append(first.split(b"\r\n", 1)[0])
            up.sendall(first)
            t = threading.Thread(target=self._pipe, args=(conn, up), daemon=True)
            t.start()
            self._pipe(up, conn)
            t.join(5)
        finally:
            for s in (conn, up):
                try:
                    s.close()
                except OSError:
                    pass

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def store(module_pg_store):
    return module_pg_store


@pytest.fixture(scope="module")
def server(store):
    with ServerThread(create_app(store, BrokerSettings(admin_token=ADMIN))) as srv:
        yield srv


@pytest.fixture
def team_client(store, server):
    """``team_client() -> (team, Client)`` for a fresh team."""
    made = []

    def make(**kw):
        team = "t" + uuid.uuid4().hex[:10]
        c = Client(server.url, create_token(store, team).token, **kw)
        made.append(c)
        return team, c

    yield make
    for c in made:
        c.close()


def future(hours: float) -> datetime:
    return (datetime.now(UTC) + timedelta(hours=hours)).replace(microsecond=0)


# ----------------------------------------------------------------------------- tests
def test_lazy_export():
    assert broker.Client is Client and broker.WaitTimeout is WaitTimeout
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        broker.Nope  # noqa: B018


def test_submit_get_list(team_client, store):
    team, c = team_client()
    dl = future(20)
    job = c.submit({"command": ["true"], "name": "bert", "image": "ghcr.io/acme/bert:3", "gpus_per_node": 2, "deadline": dl,
                    "estimated_duration_s": 5400})
    assert job.state == "submitted" and job.team == team and job.version == 1
    assert job.spec.gpus_per_node == 2 and job.spec.estimated_duration_s == 5400 and job.deadline == dl
    assert job.idempotency_key is not None  # the SDK always sends one
    uuid.UUID(job.idempotency_key)
    assert c.get(job.id) == job
    job2 = c.submit(JobSpec(command=["true"], name="gpt", gpus_per_node=8, nodes=2, gpu_types=("A100",)))
    assert job2.spec.total_gpus == 16 and job2.team == team
    assert [j.id for j in c.list()] == [job2.id, job.id]
    assert [j.id for j in c.list(limit=1)] == [job2.id]
    assert [j.id for j in c.list(state="cancelled")] == []
    assert count_jobs(store, team) == 2


def test_submit_with_same_key_is_one_job(team_client, store):
    team, c = team_client()
    a = c.submit({"command": ["true"], "gpus_per_node": 1}, idempotency_key="nightly-2024-01-01")
    b = c.submit({"command": ["true"], "gpus_per_node": 1}, idempotency_key="nightly-2024-01-01")
    assert a.id == b.id and count_jobs(store, team) == 1
    with pytest.raises(Conflict) as e:
        c.submit({"command": ["true"], "gpus_per_node": 4}, idempotency_key="nightly-2024-01-01")
    assert e.value.status == 409 and "nightly-2024-01-01" in str(e.value)
    assert count_jobs(store, team) == 1


def test_cancel_and_conflict(team_client, store):
    _, c = team_client()
    job = c.submit({"command": ["true"]})
    cancelled = c.cancel(job.id)
    assert cancelled.state == "cancelled" and cancelled.done and cancelled.cancel_requested
    done = c.submit({"command": ["true"]})
    for to in ("queued", "starting", "running", "failed"):
        store.transition(done.id, to, "test")
    with pytest.raises(Conflict, match="already failed") as e:
        c.cancel(done.id)
    assert e.value.status == 409 and e.value.detail == f"job_id={done.id!r}: already failed"


def test_wait_timeout_carries_the_last_view(team_client):
    _, c = team_client()
    job = c.submit({"command": ["true"]})
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as e:
        c.wait(job.id, timeout=0.4, poll_s=0.05)
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 3.0
    assert e.value.job.id == job.id and e.value.job.state == "submitted"
    assert isinstance(e.value, BrokerError) and e.value.status is None


def test_wait_returns_when_terminal(team_client, store):
    _, c = team_client()
    job = c.submit({"command": ["true"]})

    def finish():
        time.sleep(0.3)
        for to in ("queued", "starting", "running", "succeeded"):
            store.transition(job.id, to, "test", **({"exit_code": 0} if to == "succeeded" else {}))

    t = threading.Thread(target=finish)
    t.start()
    done = c.wait(job.id, timeout=10, poll_s=0.05)
    t.join()
    assert done.state == "succeeded" and done.exit_code == 0 and done.version == 5


def test_typed_exceptions(team_client, server, store):
    team, c = team_client()
    with pytest.raises(NotFound) as e:
        c.get("job-" + "0" * 16)
    assert e.value.status == 404
    with pytest.raises(InvalidId, match=r"^job_id='not-a-job-id': not a job id"):  # refused before a request
        c.get("not-a-job-id")
    with pytest.raises(ValidationFailed) as e:
        c.submit({"command": ["true"], "gpus_per_node": -1, "image": "busybox; rm -rf /"})
    assert e.value.status == 422
    msgs = sorted(err["msg"] for err in e.value.errors)
    assert msgs[0].startswith("spec.gpus_per_node=-1: ") and msgs[1].startswith("spec.image='busybox; rm -rf /': ")
    with pytest.raises(ValidationFailed, match=r"spec.deadline='2020-01-01T00:00:00\+00:00': must be after now"):
        c.submit({"command": ["true"], "deadline": datetime(2020, 1, 1, tzinfo=UTC)})
    with pytest.raises(ValidationFailed, match="state='nope'"):
        c.list(state="nope")
    with pytest.raises(AuthError) as e:
        c.list(team="someone-else")
    assert e.value.status == 403
    with pytest.raises(AuthError) as e:
        Client(server.url, "fbk_wrong").list()
    assert e.value.status == 401
    with pytest.raises(AuthError) as e:
        Client(server.url, token="").get("job-" + "0" * 16)
    assert e.value.status == 401 and "missing token" in str(e.value)
    assert count_jobs(store, team) == 0
    for cls in (NotFound, ValidationFailed, AuthError, Conflict, BrokerUnavailable, WaitTimeout):
        assert issubclass(cls, BrokerError)


def test_unreachable_broker():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    c = Client(f"http://127.0.0.1:{port}", "tok", retries=1)
    with pytest.raises(BrokerUnavailable, match=f"cannot reach the broker at http://127.0.0.1:{port} .*refused") as e:
        c.get("job-" + "0" * 16)
    assert e.value.status is None


def test_503_is_broker_unavailable():
    dead = JobStore("postgresql+psycopg://postgres@127.0.0.1:1/test")
    with ServerThread(create_app(dead)) as srv:
        with pytest.raises(BrokerUnavailable) as e:
            Client(srv.url, "tok", retries=1).health()
    assert e.value.status == 503
    dead.engine.dispose()


def test_logs_explain_nodes(team_client, store):
    _, c = team_client()
    job = c.submit({"command": ["true"]})
    assert c.logs(job.id) == ""
    store.transition(job.id, "queued", "test")
    store.transition(job.id, "starting", "test", attempt=1)
    store.append_log(job.id, 1, 0, 1, "world\n")
    store.append_log(job.id, 1, 0, 0, "hello ")
    assert c.logs(job.id) == "hello world\n"
    assert c.logs(job.id, attempt=1) == "hello world\n"
    with pytest.raises(NotFound, match="attempt=2"):
        c.logs(job.id, attempt=2)
    ex = c.explain(job.id)
    assert ex.job.id == job.id and ex.decision is None
    assert [e.to_state for e in ex.events] == ["submitted", "queued", "starting"]
    name = "n-" + uuid.uuid4().hex[:6]
    pool = "pool-" + uuid.uuid4().hex[:6]
    store.heartbeat(name, pool, "A100", 4, 80.0, [0, 1, 2, 3], "agent-x")
    # a team token: the free capacity per pool and GPU type (NodeCapacityView), no node detail
    assert [(n.gpu_type, n.nodes, n.gpus, n.healthy_gpus, n.free_gpus) for n in c.nodes() if n.pool == pool] == [
        ("A100", 1, 4, 4, 4)]
    admin = Client(c.url, ADMIN)
    mine = [n for n in admin.nodes() if n.name == name]
    assert len(mine) == 1 and mine[0].gpu_count == 4 and mine[0].healthy_gpus == [0, 1, 2, 3]


def test_env_defaults(monkeypatch, server, store):
    tok = create_token(store, "envteam").token
    monkeypatch.setenv("FEDBROKER_API_URL", server.url + "/")
    monkeypatch.setenv("FEDBROKER_TOKEN", tok)
    c = Client()
    assert c.url == server.url
    assert c.submit({"command": ["true"]}).team == "envteam"


def test_admin_sees_every_team(team_client, server):
    a, ca = team_client()
    b, cb = team_client()
    ja, jb = ca.submit({"command": ["true"]}), cb.submit({"command": ["true"]})
    admin = Client(server.url, ADMIN)
    assert admin.get(ja.id).team == a and admin.get(jb.id).team == b
    assert [j.id for j in admin.list(team=b)] == [jb.id]
    with pytest.raises(NotFound):
        cb.get(ja.id)


def test_retried_submit_creates_one_job(team_client, server, store):
    """The first answer is lost after the API stored the job; the SDK retries the POST with
    the same idempotency key and gets the same job back."""
    proxy = DropFirstResponseProxy(server.port)
    try:
        team, c0 = team_client()
        c = Client(proxy.url, c0.token, retries=3)
        job = c.submit({"command": ["true"], "name": "retried", "gpus_per_node": 2})
    finally:
        proxy.close()
    assert proxy.requests == [b"POST /v1/jobs HTTP/1.1", b"POST /v1/jobs HTTP/1.1"]
    assert proxy.dropped is not None and proxy.dropped.startswith(b"HTTP/1.1 201")
    assert job.id.encode() in proxy.dropped  # the lost answer named the same job
    assert job.name == "retried"
    assert count_jobs(store, team) == 1


# ----------------------------------------------------------------------------- tokens and audit
def test_token_methods_and_their_errors(store, server):
    team = "t" + uuid.uuid4().hex[:10]
    with Client(server.url, ADMIN) as admin:
        ta = admin.create_token(team=team, kind="team-admin", label="lead", ttl_s=86400)
        assert (ta.team, ta.kind, ta.label) == (team, "team-admin", "lead") and ta.token.startswith("fbk_")
        assert ta.expires_at - ta.created_at == timedelta(days=1)
        with pytest.raises(ValidationFailed) as e:
            admin.create_token(team=team, kind="node")
        assert e.value.errors[0]["loc"] == ["body", "node"]
        with pytest.raises(NotFound):
            admin.revoke_token("tok-0000000000000000")
    with Client(server.url, ta.token) as lead:
        ro = lead.create_token(kind="read-only")
        assert (ro.team, ro.kind) == (team, "read-only")
        with pytest.raises(AuthError) as e:
            lead.create_token(kind="admin")
        assert e.value.status == 403
        assert [t.id for t in lead.tokens()] == [ta.id, ro.id]
        rotated = lead.rotate_token(ro.id, ttl_s=3600)
        assert rotated.rotated_from == ro.id and rotated.kind == "read-only"
        with pytest.raises(Conflict):
            lead.rotate_token(ro.id)
        assert lead.revoke_token(rotated.id).revoked is True
        assert [t.id for t in lead.tokens(include_revoked=True)] == [ta.id, ro.id, rotated.id]
        with pytest.raises(AuthError) as e:
            lead.audit()
        assert e.value.status == 403
    with Client(server.url, ADMIN) as admin:
        events = admin.audit(action="token.rotate", limit=5)
        assert (events[0].target, events[0].actor_token_id, events[0].detail["new_token_id"]) == (ro.id, ta.id,
                                                                                                  rotated.id)
    with Client(server.url, rotated.token) as gone:
        with pytest.raises(AuthError) as e:
            gone.list()
        assert e.value.status == 401 and e.value.detail == "unknown or revoked token"


# ----------------------------------------------------------------------------- ids in URL paths (issue #9)
class _Recorder:
    """A local HTTP server that answers every request 200 ``{}`` and records its method and raw path."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                seen.append((self.command, self.path))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


HOSTILE = [("cancel", "job_id", "../tokens/tok-0123456789abcdef/revoke?"), ("get", "job_id", "../tokens?x="),
           ("logs", "job_id", "../../healthz?"), ("explain", "job_id", "%2e%2e"),
           ("get", "job_id", "job-0123456789abcdef\n"), ("logs_view", "job_id", "job-0123456789abcdef/../x"),
           ("wait", "job_id", ".."), ("get_schedule", "schedule_id", "../jobs?"),
           ("pause_schedule", "schedule_id", "sch-0123456789abcdef/../../tokens"),
           ("delete_schedule", "schedule_id", ""), ("revoke_token", "token_id", "../jobs/job-0123456789abcdef/cancel?"),
           ("rotate_token", "token_id", "tok-0123456789ABCDEF"), ("cancel", "job_id", 7)]


@pytest.mark.parametrize("method,field,value", HOSTILE)
def test_a_hostile_id_is_refused_before_any_request(method, field, value):
    rec = _Recorder()
    try:
        with Client(rec.url, "fbk_x") as c:
            with pytest.raises(ValueError, match=rf"^{field}={re.escape(repr(value))}: not a ") as e:
                getattr(c, method)(value)
            assert isinstance(e.value, InvalidId) and (e.value.field, e.value.value) == (field, value)
            assert rec.seen == []
            c.delete_schedule("sch-0123456789abcdef")  # the recorder does see a well-formed id's request
            assert rec.seen == [("DELETE", "/v1/schedules/sch-0123456789abcdef")]
    finally:
        rec.close()


def test_a_hostile_job_id_no_longer_revokes_a_token(team_client, server, store):
    """The reported exploit end to end: ``cancel("../tokens/<id>/revoke?")`` revoked a token."""
    team, c = team_client()
    victim = create_token(store, team)
    with pytest.raises(InvalidId):
        c.cancel(f"../tokens/{victim.id}/revoke?")
    with Client(server.url, victim.token) as v:
        assert v.list() == []  # the victim's token still works
