"""``POST /v1/instances/report``: what the endpoint refuses before the cloud broker sees a report.

The endpoint calls only ``check_token`` and ``report`` of its cloud broker; a stand-in records the reports and
raises the real :class:`broker.service.cloud.ReportError` for an unknown event, as ``CloudBroker.report`` does.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.cloud import REPORT_EVENTS, ReportError

TOKEN = "t" * 43
URL = "/v1/instances/report"


class StandIn:
    def __init__(self):
        self.reports: list[tuple] = []

    def check_token(self, job_id: str, attempt: int, rank: int, token: str) -> bool:
        return token == TOKEN

    def report(self, job_id, attempt, rank, event, exit_code=None, reason="", log_tail="", seq=None):
        if event not in REPORT_EVENTS:
            raise ReportError(422, f"event={event!r}: must be one of {', '.join(REPORT_EVENTS)}")
        self.reports.append((job_id, attempt, rank, event, exit_code))
        return "running" if event == "running" else "ok"


@pytest.fixture
def cloud():
    return StandIn()


@pytest.fixture
def client(sqlite_store, cloud):
    return TestClient(create_app(sqlite_store, cloud=cloud))


def _form(**kw) -> dict:
    return {"job_id": "job-0123456789abcdef", "attempt": "2", "rank": "0", "event": "running", "seq": "1", **kw}


def _post(client, token=TOKEN, **form):
    return client.post(URL, data=_form(**form), headers={"Authorization": f"Bearer {token}"})


def test_a_good_report_reaches_the_cloud_broker(client, cloud):
    assert _post(client).json() == {"outcome": "running"}
    r = _post(client, event="exited", exit_code="-9", rank="1")
    assert r.status_code == 200, r.text
    assert cloud.reports == [("job-0123456789abcdef", 2, 0, "running", None),
                             ("job-0123456789abcdef", 2, 1, "exited", -9)]


def test_an_unknown_event_is_named_once(client, cloud):
    r = _post(client, event="booted")
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"] == "event='booted': must be one of running, notice, exited"
    assert r.json()["detail"][0]["loc"] == ["body", "event"]
    assert cloud.reports == []


def test_a_body_that_is_not_a_form_is_415(client, cloud):
    r = client.post(URL, content=json.dumps(_form()), headers={"Authorization": f"Bearer {TOKEN}",
                                                              "Content-Type": "application/json"})
    assert r.status_code == 415
    assert r.json()["detail"] == ("body must be application/x-www-form-urlencoded (the form fields job_id, attempt, "
                                  "rank, event, seq, exit_code, reason, log_tail)")
    r = client.post(URL, content=b"job_id=x", headers={"Authorization": f"Bearer {TOKEN}"})  # no Content-Type
    assert r.status_code == 415
    # curl --data-urlencode, with a charset parameter: taken
    r = client.post(URL, content="job_id=job-0123456789abcdef&attempt=2&rank=0&event=running&seq=1",
                    headers={"Authorization": f"Bearer {TOKEN}",
                             "Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
    assert r.json() == {"outcome": "running"}
    assert cloud.reports == [("job-0123456789abcdef", 2, 0, "running", None)]


def test_no_token_is_401_saying_which_token(client, cloud):
    r = client.post(URL, data=_form())
    assert r.status_code == 401
    assert r.json()["detail"] == "missing token: send 'Authorization: Bearer <the instance's report token>'"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    r = client.post(URL, data=_form(), headers={"Authorization": "Bearer "})
    assert r.status_code == 401 and r.json()["detail"].startswith("missing token")
    r = _post(client, token="u" * 43)
    assert r.status_code == 401 and r.json()["detail"] == "not the report token of this job attempt and rank"
    assert cloud.reports == []


@pytest.mark.parametrize("field,value", [("attempt", " 2"), ("attempt", "+2"), ("attempt", "2_0"), ("attempt", "-1"),
                                         ("attempt", "2\n"), ("attempt", "٢"), ("rank", "0x1"), ("rank", "1.0"),
                                         ("rank", "+0"), ("rank", "2147483648"), ("attempt", "9" * 30)])
def test_attempt_and_rank_are_digits_only(client, cloud, field, value):
    r = _post(client, **{field: value})
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"] == f"{field}={value!r}: must be an integer in [0, 2147483647]"
    assert cloud.reports == []


@pytest.mark.parametrize("value", [" 1", "+1", "1_0", "--1", "1 ", "0x1", "٣", "2147483648", "-2147483649",
                                   "99999999999999999999"])
def test_exit_code_is_an_optional_minus_and_digits(client, cloud, value):
    r = _post(client, event="exited", exit_code=value)
    assert r.status_code == 422
    assert r.json()["detail"][0]["msg"] == (f"exit_code={value!r}: must be empty or an integer in "
                                            "[-2147483648, 2147483647]")
    assert cloud.reports == []


def test_a_missing_field_is_named(client):
    r = client.post(URL, data={"job_id": "job-0123456789abcdef", "attempt": "1", "event": "running"},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["detail"][0]["msg"] == "rank=None: field required"


def test_a_body_that_is_not_utf8_is_422_saying_where(client, cloud):
    raw = b"job_id=job-0123456789abcdef&attempt=2&rank=0&event=running&seq=1&reason=caf\xe9"
    r = client.post(URL, content=raw, headers={"Authorization": f"Bearer {TOKEN}",
                                               "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422
    assert r.json()["detail"] == "body: not valid UTF-8 (byte 0xe9 at offset 75: unexpected end of data)"
    assert cloud.reports == []


def test_a_log_tail_cut_mid_character_is_taken(client, cloud):
    """``tail -c`` may cut a UTF-8 character: percent-encoded, it is replaced, not refused."""
    raw = b"job_id=job-0123456789abcdef&attempt=2&rank=0&event=exited&exit_code=0&seq=1&log_tail=%A9done"
    r = client.post(URL, content=raw, headers={"Authorization": f"Bearer {TOKEN}",
                                               "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and cloud.reports == [("job-0123456789abcdef", 2, 0, "exited", 0)]
