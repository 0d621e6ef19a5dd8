"""fedbroker: a hybrid-cloud, energy-aware federation broker for GPU training jobs.

``broker.Client`` (the SDK, :mod:`broker.client`) and its exceptions are imported on
first use, so ``import broker`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

#: the bundled real data of the broker package (cluster files, the Philly trace; attribution in its SOURCES.md)
DATA_DIR = Path(__file__).resolve().parent / "data"

if TYPE_CHECKING:  # pragma: no cover
    from broker.client import (AuthError, BrokerError, BrokerUnavailable, Client, Conflict, NotFound,
                               RateLimited, ValidationFailed, WaitTimeout)

_LAZY = {"Client", "BrokerError", "AuthError", "NotFound", "ValidationFailed", "Conflict", "BrokerUnavailable",
         "WaitTimeout", "RateLimited"}

__all__ = sorted(_LAZY | {"DATA_DIR"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from broker import client

        return getattr(client, name)
    raise AttributeError(f"module 'broker' has no attribute {name!r}")
