"""The SDK against a server that is not (quite) a fedbroker API: a stub ``http.server`` on 127.0.0.1 answering what
a hostile review sent (a negative Retry-After, a body that is not JSON, JSON of another shape, an HTML error page)."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from typer.testing import CliRunner

from broker.client import MIN_RETRY_AFTER_S, BrokerUnavailable, Client, UnexpectedAnswer


class _Stub:
    """Answers each request with the next of ``answers`` (``(status, headers, body)``), the last one again after."""

    def __init__(self, answers):
        self.answers, self.seen = list(answers), []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                stub.seen.append((time.monotonic(), self.path))
                status, headers, body = stub.answers[min(len(stub.seen), len(stub.answers)) - 1]
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    made = []

    def make(*answers):
        made.append(_Stub(answers))
        return made[-1]

    yield make
    for s in made:
        s.close()


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("retry_after", ["-5", "0", "nan", "Thu, 01 Jan 1970 00:00:00 GMT"])
def test_a_retry_after_below_the_minimum_waits_the_minimum(stub, retry_after):
    """2,490 requests in 3 s against ``Retry-After: -5`` (each taken as a 0 s wait)."""
    s = stub((429, {**JSON, "Retry-After": retry_after}, b'{"detail": "slow down"}'), (200, JSON, b"[]"))
    assert Client(s.url, "tok", retries=0, max_rate_wait_s=10).list() == []
    assert len(s.seen) == 2
    assert s.seen[1][0] - s.seen[0][0] >= MIN_RETRY_AFTER_S - 0.05


@pytest.mark.parametrize("body, message", [
    (b"<html>hello</html>", "answered 200 with a body that is not JSON (<html>hello</html>): is this a fedbroker API?"),
    (b'{"jobs": "no"}', "an answer that is not a list of JobView: is this a fedbroker API?"),
    (b'[{"id": 1}]', "an answer that is not a JobView ("),
])
def test_an_answer_a_fedbroker_api_does_not_send_is_unexpected_answer(stub, body, message):
    s = stub((200, JSON, body))
    with pytest.raises(UnexpectedAnswer) as e:
        Client(s.url, "tok", retries=0).list()
    assert message in str(e.value)


def test_an_html_error_page_is_cut_in_the_message(stub):
    s = stub((500, {"Content-Type": "text/html"}, b"<html>" + b"x" * 5000 + b"</html>"))
    with pytest.raises(BrokerUnavailable) as e:
        Client(s.url, "tok", retries=0).list()
    assert len(str(e.value)) < 250 and str(e.value).startswith("500 <html>xxx")


def test_the_cli_says_it_in_one_line(stub, monkeypatch):
    from broker.cli.main import app

    s = stub((200, JSON, b"not json"))
    monkeypatch.setenv("FEDBROKER_API_URL", s.url)
    monkeypatch.setenv("FEDBROKER_TOKEN", "tok")
    r = CliRunner().invoke(app, ["list"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "with a body that is not JSON (not json): is this a fedbroker API?" in " ".join(r.output.split())
