"""Group commit of the API's single submits: the ``POST /v1/jobs`` requests that one API process has in
flight at the same time are stored together, in one transaction (:meth:`JobStore.submit_group`),
instead of one transaction (and one commit) each.

One writer thread per process takes every submit waiting when it is free: nothing is held back to wait
for company, so a lone submit is stored at once, and under load each group is what arrived while the
previous group was being committed (at most ``max_group``). Each request awaits its own answer, which is
exactly what a submit of its own would have given (the store falls back to one transaction per item
whenever grouping could change an answer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from typing import Callable

from broker.schemas import JobView
from broker.service.store.core import JobStore, SubmitItem, SubmitWriter

__all__ = ["GroupCommit"]

log = logging.getLogger(__name__)

#: a queued submit: the item, the future its request awaits and that future's event loop
_Pending = tuple[SubmitItem, "asyncio.Future[tuple[JobView, bool]]", asyncio.AbstractEventLoop]


class GroupCommit:
    """Store concurrent single submits in groups (module docstring).

    Args:
        store: the job store.
        on_created: called in the writer thread with each new job's id once its group is committed,
            before the requests are answered (the live broker wakes the planner); an exception from it is
            logged and changes no answer.
        max_group: the most submits stored in one transaction (>= 1; ``ValueError`` otherwise).
    """

    def __init__(self, store: JobStore, on_created: Callable[[str], None] | None = None, max_group: int = 64):
        if max_group < 1:
            raise ValueError(f"max_group={max_group}: must be >= 1")
        self.store = store
        self.on_created = on_created
        self.max_group = max_group
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    async def submit(self, item: SubmitItem) -> tuple[JobView, bool]:
        """Store ``item`` with whatever else is waiting; returns ``(job, created)`` as
        :meth:`JobStore.submit` does and raises what it would raise (``IdempotencyConflict``,
        ``QuotaExceeded``, a database error). A request cancelled while waiting (the client went away)
        does not unstore its job, as with a plain submit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[JobView, bool]] = loop.create_future()
        self._start()
        self._queue.put((item, fut, loop))
        return await fut

    def _start(self) -> None:
        """Start the writer thread unless this process runs one (a forked child starts its own)."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's queue and thread are not ours
                self._queue = queue.SimpleQueue()
                self._thread = None
                self._pid = os.getpid()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fedbroker-submit-group", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        writer = self.store.submit_writer()  # this thread's own connection, kept between groups
        while True:
            group = [self._queue.get()]
            while len(group) < self.max_group:
                try:
                    group.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._store(writer, group)
            except BaseException:  # never let the writer die: the group's requests are answered below
                log.exception("group commit of %d submits failed", len(group))

    def _store(self, writer: SubmitWriter, group: list[_Pending]) -> None:
        try:
            results: list = writer.submit_group([item for item, _, _ in group])
        except Exception as e:  # the database is unreachable, say: every request gets the error
            results = [e] * len(group)
        if self.on_created is not None:
            for r in results:
                if isinstance(r, tuple) and r[1]:
                    try:
                        self.on_created(r[0].id)
                    except Exception:
                        log.exception("on_submit(%s) failed; the job is stored and the next planner tick sees it",
                                      r[0].id)
        for (_, fut, loop), r in zip(group, results):
            try:
                loop.call_soon_threadsafe(_settle, fut, r)
            except RuntimeError:  # the request's loop is closed (the process is stopping)
                pass


def _settle(fut: asyncio.Future, result: object) -> None:
    """Answer ``fut`` with ``result`` (an exception is raised in the awaiting request) unless it was cancelled."""
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
