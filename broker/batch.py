"""The bulk submit (``POST /v1/jobs:batch``): its request and response bodies.

A batch holds 1-:data:`MAX_BATCH_ITEMS` items, each what ``POST /v1/jobs`` takes
(:class:`broker.schemas.SubmitRequest`: ``spec`` and an optional ``idempotency_key``). Items are
validated one by one, so a bad item is answered in its own result and does not reject the others.
Every item gets one :class:`BatchItemResult`, in order, with the status the single submit would
have answered:

* ``201`` created (``job``), ``200`` an idempotent replay (``job``: the job stored before with that key
  and the same spec, also by an earlier item of the same batch);
* ``422`` the item is invalid (``detail``: the errors, ``loc`` starting ``["body", "items", i, ...]``,
  ``msg`` naming the dotted field and value), ``403`` its ``spec.team`` is another team, ``409`` its key
  was used with another spec.

The whole batch is answered 429 (nothing stored) when its new jobs exceed the team's submit rate or
queued-jobs quota (:mod:`broker.service.limits`); the rate limit charges one token per new job.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from broker.schemas import JobView

__all__ = ["MAX_BATCH_ITEMS", "BatchRequest", "BatchItemResult", "BatchResponse"]

#: the most items one batch may hold (the SDK's ``submit_many`` sends chunks of this size)
MAX_BATCH_ITEMS = 1000


class BatchRequest(BaseModel):
    """Body of ``POST /v1/jobs:batch``: ``items``, each a ``SubmitRequest`` object (``{"spec": ...,
    "idempotency_key": ...}``), validated one by one (a bad item gets its own 422 result)."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH_ITEMS,
                                        description="1-1000 SubmitRequest objects ({spec, idempotency_key})",
                                        json_schema_extra={"items": {"$ref": "#/components/schemas/SubmitRequest"}})


class BatchItemResult(BaseModel):
    """The outcome of one item: ``index`` in the request, ``status`` (201 created, 200 existing job,
    403, 409, 422), ``job`` (201/200) or ``detail`` (a message, or for 422 the list of errors)."""

    index: int
    status: int
    job: JobView | None = None
    detail: Any = None


class BatchResponse(BaseModel):
    """Body of a ``POST /v1/jobs:batch`` answer: one result per item, in order, and the counts."""

    results: list[BatchItemResult]
    created: int = Field(description="items answered 201")
    existing: int = Field(description="items answered 200 (idempotent replays)")
    failed: int = Field(description="items answered 403, 409 or 422 (nothing stored for them)")
