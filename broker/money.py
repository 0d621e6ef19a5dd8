"""Money and the ledger's other decimal figures as text: the one home of their rounding (issue #20 item 7).

The ledger computes in binary floating point (USD, kWh, kgCO2e, hours), whose last digits are noise
(``0.1 + 0.2 = 0.30000000000000004``; a saving of ``a - a'`` that should be 0 comes out ``2.2e-16``). What
leaves the broker goes through here:

* **Exact figures** (the FOCUS export, the API's sums): :func:`exact` rounds to :data:`QUANTUM`, ``1e-10``
  (of a USD, kWh, kg or hour), half to even, as a :class:`decimal.Decimal`; :func:`exact_text` writes it as a
  plain decimal (no exponent, no trailing zeros, never ``-0``). Why ``1e-10``: the smallest line the ledger
  writes is about a second of the cheapest GPU (~0.1 USD/h, i.e. ~3e-5 USD), which keeps at least 5
  significant digits, while a float's noise on figures below 1e5 USD is under ~1e-11 (2**-52 relative).
* **Exact quantities** (FOCUS's PricingQuantity, ConsumedQuantity, kWh, kgCO2e, GPU-hours): a quantity such
  as 60 s = 1/60 h has no finite decimal, so it keeps :data:`QUANTITY_DIGITS` (15) significant digits
  (:func:`exact_quantity`, :func:`exact_quantity_text`): a float's 15 digits read back exactly (C's
  ``DBL_DIG``), the 16th and 17th are its binary noise (``0.30000000000000004`` kWh is ``0.3``). So
  ``ListUnitPrice x PricingQuantity`` (36 USD/h x 0.0166666666666667 h) gives the ListCost 0.6 at 1e-10.
* **Shown figures** (``fedbroker cost report``, ``budgets``, the finance page): every figure of one column
  with the same number of decimals (so a column's visible rows add up to its visible total, to within one
  unit of the last digit), chosen by :func:`decimals_for` so that the column's smallest non-zero figure
  still shows :data:`SIGNIFICANT` (2) significant digits (0.0125 and 0.0287 as 0.013 and 0.029, total
  0.041; not 0.01 + 0.03 = 0.04 shown as 0.03), and at least :data:`LEAST_DECIMALS` (cents); :func:`figure_text` writes one. The finance page's script
  (``broker/service/static/finance.js``, ``decimalsFor``/``figureText``) applies the same rule to the same
  (already :func:`exact`) figures; its Playwright test checks both give the same text.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Context, Decimal, InvalidOperation
from typing import Iterable

__all__ = ["QUANTUM", "QUANTITY_DIGITS", "exact_quantity", "exact_quantity_text", "SIGNIFICANT", "LEAST_DECIMALS", "MOST_DECIMALS", "exact", "exact_float", "exact_text",
           "decimals_for", "figure_text"]

#: the resolution of an exact figure: 1e-10 USD (kWh, kgCO2e, hours); the module docstring says why
QUANTUM = Decimal("1E-10")
#: significant digits of an exact quantity (C's ``DBL_DIG``: every 15-digit decimal survives a float round trip)
QUANTITY_DIGITS = 15
#: significant digits a shown column keeps for its smallest non-zero figure
SIGNIFICANT = 2
#: the arithmetic of :func:`exact`: 60 digits hold any figure below 1e49 at :data:`QUANTUM` (a larger one is refused)
_CONTEXT = Context(prec=60)
#: decimals a shown figure has at least (cents)
LEAST_DECIMALS = 2
#: decimals a shown figure has at most: :data:`QUANTUM`'s
MOST_DECIMALS = 10


def exact(v: float | int | Decimal | None) -> Decimal | None:
    """``v`` rounded to :data:`QUANTUM` (half to even) as a ``Decimal`` (``-0`` becomes ``0``); ``None`` for
    ``None``. Raises ``ValueError`` naming the value when it is not finite (NaN, inf) or not a number."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
        raise ValueError(f"{v!r}: not a number")
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r}: not a finite number")
        d = Decimal(repr(v))  # the shortest decimal that reads back as v
    else:
        d = Decimal(v)
        if not d.is_finite():
            raise ValueError(f"{v!r}: not a finite number")
    try:
        d = d.quantize(QUANTUM, rounding=ROUND_HALF_EVEN, context=_CONTEXT)
    except InvalidOperation:
        raise ValueError(f"{v!r}: too large for a ledger figure (at most 1e49)") from None
    return d if d else abs(d)  # 0E-10, never -0E-10


def exact_float(v: float | int | Decimal | None) -> float | None:
    """:func:`exact` as a float (what the JSON API answers): ``0.1 + 0.2`` is ``0.3``; ``None`` for ``None``."""
    d = exact(v)
    return None if d is None else float(d)


def exact_text(v: float | int | Decimal | None) -> str:
    """:func:`exact` as a plain decimal: ``"0.0003168785"``, ``"12.5"``, ``"100"``, ``"0"``, ``"-0.25"`` (no
    exponent, no ``+``, no trailing zeros, never ``-0``); ``""`` for ``None`` (FOCUS's null)."""
    d = exact(v)
    if d is None:
        return ""
    return "0" if not d else format(d.normalize(), "f")


def exact_quantity(v: float | int | Decimal | None) -> Decimal | None:
    """``v`` rounded to :data:`QUANTITY_DIGITS` significant digits (half to even) as a ``Decimal`` (``-0``: ``0``);
    ``None`` for ``None``. Raises ``ValueError`` naming the value when it is not a finite number."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
        raise ValueError(f"{v!r}: not a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v!r}: not a finite number")
    d = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
    if not d.is_finite():
        raise ValueError(f"{v!r}: not a finite number")
    if not d:
        return abs(d)
    return d.quantize(Decimal(1).scaleb(d.adjusted() - QUANTITY_DIGITS + 1), rounding=ROUND_HALF_EVEN,
                      context=_CONTEXT)


def exact_quantity_text(v: float | int | Decimal | None) -> str:
    """:func:`exact_quantity` as a plain decimal (``"0.0166666666666667"``, ``"0.3"``, ``"3"``; never ``-0``);
    ``""`` for ``None``. Raises ``ValueError`` as :func:`exact_quantity`."""
    d = exact_quantity(v)
    if d is None:
        return ""
    return "0" if not d else format(d.normalize(), "f")


def decimals_for(values: Iterable[float | int | Decimal | None], significant: int = SIGNIFICANT,
                 least: int = LEAST_DECIMALS, most: int = MOST_DECIMALS) -> int:
    """The decimals one shown column of ``values`` uses: enough for its smallest non-zero :func:`exact` figure
    to show ``significant`` significant digits, at least ``least``, at most ``most`` (``None`` and 0 are
    ignored). ``[0.0125, 0.0287]`` -> 3; ``[1234.5, 0.5]`` -> 2; ``[]`` -> 2. Raises ``ValueError`` as :func:`exact`."""
    small = [abs(d) for d in map(exact, values) if d]
    if not small:
        return least
    exponent = min(small).adjusted()  # 0.0125 -> -2
    return max(least, min(most, significant - 1 - exponent))


def figure_text(v: float | int | Decimal | None, decimals: int = LEAST_DECIMALS, *, grouped: bool = True) -> str:
    """One shown figure: :func:`exact` ``v`` with ``decimals`` decimals (half away from zero, as a reader rounds
    by hand: 0.0125 -> 0.013), thousands grouped with
    ``,`` unless ``grouped`` is false; ``"-"`` for ``None`` (unknown, never 0); never ``-0.00``. Raises
    ``ValueError`` as :func:`exact`."""
    d = exact(v)
    if d is None:
        return "-"
    q = d.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP, context=_CONTEXT)
    if not q:
        q = abs(q)  # never -0.00
    return format(q, ",f" if grouped else "f")
