"""Exceptions raised by :mod:`pricing`.

Every error is a ``ValueError`` (bad input, not a transient fault) and its
message names the offending field and value::

    ValueError
    ├── SeriesError          (pricing.series)  malformed time-series input
    ├── UnknownZoneError     grid zone without bundled data; lists the zones that have it
    ├── UnknownCurrencyError currency missing from the FX table
    └── UnknownGpuTypeError  GPU name that maps to no canonical type
"""

from __future__ import annotations

from typing import Iterable

from pricing.series import SeriesError

__all__ = ["SeriesError", "UnknownZoneError", "UnknownCurrencyError", "UnknownGpuTypeError"]


class UnknownZoneError(ValueError):
    """A grid zone has no bundled series of the requested kind."""

    def __init__(self, zone: object, kind: str, available: Iterable[str]):
        self.zone = zone
        self.kind = kind
        self.available = tuple(sorted(available))
        super().__init__(f"zone={zone!r}: no bundled {kind} series; available: {', '.join(self.available)}")


class UnknownCurrencyError(ValueError):
    """A currency code is not in :data:`pricing.fx.USD_PER_UNIT`."""

    def __init__(self, currency: object, available: Iterable[str]):
        self.currency = currency
        self.available = tuple(sorted(available))
        super().__init__(f"currency={currency!r}: no FX rate; known: {', '.join(self.available)}")


class UnknownGpuTypeError(ValueError):
    """A GPU name maps to no canonical GPU type in :data:`pricing.power.GPU_SPECS`."""

    def __init__(self, name: object, known: Iterable[str]):
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"gpu_type={name!r}: unknown GPU type; known: {', '.join(self.known)}")
