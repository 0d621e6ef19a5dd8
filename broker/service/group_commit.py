"""Group commit of the API's single submits: the ``POST /v1/jobs`` requests that one API process has in
flight at the same time are stored together, in one transaction (:meth:`SubmitWriter.try_group`),
instead of one transaction (and one commit) each.

One writer thread per process takes every submit waiting when it is free: nothing is held back to wait
for company, so a lone submit is stored at once, and under load each group is what arrived while the
previous group was being committed (at most ``max_group``). Each request awaits its own answer. When a
group cannot be stored as a whole (an idempotency key used before, a team at its quota, a row lock held
by a team's bulk submit, ...) nothing of it is stored and each of its requests submits alone, in its own
worker thread as before group commit existed: exactly the answer a submit of its own would have given,
and no team's submit waits behind another team's lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from typing import Callable

from starlette.concurrency import run_in_threadpool

from broker.schemas import JobView
from broker.service.store.core import JobStore, SubmitItem, SubmitWriter

__all__ = ["GroupCommit", "IDLE_RELEASE_S"]

log = logging.getLogger(__name__)

#: seconds without a submit after which the writer gives its held database connection back to the pool
IDLE_RELEASE_S = 5.0
#: the answer of a submit whose group stored nothing: the request submits it alone
_ALONE = object()
#: what the writer's queue holds: a submit, the future its request awaits and that future's loop; None stops it
_Pending = tuple[SubmitItem, "asyncio.Future", asyncio.AbstractEventLoop]


class GroupCommit:
    """Store concurrent single submits in groups (module docstring).

    Args:
        store: the job store.
        on_created: called with each new job's id once it is stored, before its request is answered (the
            live broker wakes the planner: it must not block); an exception from it is logged and changes
            no answer.
        max_group: the most submits stored in one transaction (>= 1; ``ValueError`` otherwise).
    """

    def __init__(self, store: JobStore, on_created: Callable[[str], None] | None = None, max_group: int = 64):
        if max_group < 1:
            raise ValueError(f"max_group={max_group}: must be >= 1")
        self.store = store
        self.on_created = on_created
        self.max_group = max_group
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    async def submit(self, item: SubmitItem) -> tuple[JobView, bool]:
        """Store ``item`` with whatever else is waiting; returns ``(job, created)`` as
        :meth:`JobStore.submit` does and raises what it would raise (``IdempotencyConflict``,
        ``QuotaExceeded``, a database error). A request cancelled while waiting (the client went away)
        does not unstore its job, as with a plain submit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._start()
        self._queue.put((item, fut, loop))
        done = await fut
        if done is _ALONE:
            return await run_in_threadpool(self._alone, item)
        return done

    def _alone(self, it: SubmitItem) -> tuple[JobView, bool]:
        job, created = self.store.submit_item(it)
        if created:
            self._created(job.id)
        return job, created

    def _created(self, job_id: str) -> None:
        if self.on_created is not None:
            try:
                self.on_created(job_id)
            except Exception:
                log.exception("on_submit(%s) failed; the job is stored and the next planner tick sees it", job_id)

    def close(self) -> None:
        """Stop the writer once the submits queued before are answered; it gives its connection back.
        A later :meth:`submit` starts a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and self._pid == os.getpid():
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

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
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="fedbroker-submit-group",
                                                daemon=True)
                self._thread.start()

    def _run(self, q: queue.SimpleQueue) -> None:
        writer = self.store.submit_writer()  # this thread's own connection, kept between groups
        try:
            while True:
                try:
                    first = q.get(timeout=IDLE_RELEASE_S)
                except queue.Empty:
                    writer.close()  # idle: the connection goes back to the pool (taken again when needed)
                    continue
                if first is None:
                    return
                group = [first]
                stop = False
                while len(group) < self.max_group:
                    try:
                        nxt = q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                        break
                    group.append(nxt)
                try:
                    self._store(writer, group)
                except BaseException:  # never let the writer die with requests waiting
                    log.exception("group commit of %d submits failed", len(group))
                if stop:
                    return
        finally:
            writer.close()

    def _store(self, writer: SubmitWriter, group: list[_Pending]) -> None:
        try:
            done = writer.try_group([item for item, _, _ in group])
        except Exception as e:  # the database is unreachable, say: every request gets the error
            results: list = [e] * len(group)
        else:
            if done is None:
                results = [_ALONE] * len(group)
            else:
                results = done
                for job, created in done:
                    if created:
                        self._created(job.id)
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
