"""A job's log over ``log_max_bytes`` keeps its head AND its tail through the whole node path (shim -> agent ->
node API -> store -> ``GET /v1/jobs/{id}/logs``): the traceback at the end of a crash is what a user needs, and
the cap used to drop it (issue #20 item 3, finding #4). Real agent, real PostgreSQL.

Hand-checked: the job writes ``first\\n`` + 10,000 ``x`` + ``\\nTraceback: boom\\n`` (10,023 bytes) through a
4,096-byte cap: head 4096 - 2048 - 64 = 1,984 bytes, tail 2,048 bytes, 5,991 dropped.
"""

from __future__ import annotations

from broker.log_marker import dropped_marker
from tests.workers.rig import sh


def test_a_crashing_jobs_traceback_survives_the_log_cap(pg_store, rig):
    rig = rig({"n1": 1})
    rig.settings.log_max_bytes = 4096
    for a in rig.agents.values():
        a._config = None  # asks the API's config again: the new cap
    jid = pg_store.submit("ml", sh("echo first; head -c 10000 /dev/zero | tr '\\0' x; echo; echo 'Traceback: boom'; "
                                   "exit 1"))[0].id
    rig.until(lambda: rig.state(jid) == "failed", what="the job to fail")
    text = "".join(t for _, t in pg_store.log_chunks(jid, 1))
    assert text == "first\n" + "x" * 1978 + dropped_marker(5991) + "x" * 2031 + "\nTraceback: boom\n"
    assert len(text.encode()) == 1984 + 41 + 2048
