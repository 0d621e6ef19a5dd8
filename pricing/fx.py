"""Currency conversion to USD with a fixed, dated reference table.

``USD_PER_UNIT[cur]`` is how many US dollars one unit of ``cur`` buys.

Period and source: approximate **calendar-2023 annual averages** of daily
reference rates — U.S. Federal Reserve Board, H.10 "Foreign Exchange Rates",
annual averages for 2023 (EUR, GBP, AUD quoted as USD per unit; CAD, JPY, KRW,
SGD, BRL, INR quoted as units per USD and inverted here), cross-checked
against the ECB euro reference rates' 2023 average (USD 1.0813 per EUR). CLP is
not in H.10; its rate is the approximate 2023 average of the Banco Central de
Chile "dólar observado" (~840 CLP per USD). Values are rounded to 4
significant digits and are **approximate**: good enough to put 2023-2024
electricity prices from different markets on one scale, not for accounting.
2023 was chosen because the bundled electricity series span 2023-2024; a
single rate is used for the whole span (no daily FX).

Errors: :class:`pricing.errors.UnknownCurrencyError` (a ``ValueError``) names
an unknown currency code.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from pricing.errors import UnknownCurrencyError

__all__ = ["USD_PER_UNIT", "FX_PERIOD", "FX_SOURCE", "usd_per_unit", "to_usd"]

FX_PERIOD = "2023 annual average"
FX_SOURCE = "Federal Reserve H.10 annual averages 2023 (ECB 2023 average for EUR cross-check; BCCh for CLP); approximate"

#: USD per one unit of currency (2023 annual average, approximate; see module docstring).
USD_PER_UNIT: MappingProxyType[str, float] = MappingProxyType({
    "USD": 1.0,
    "EUR": 1.0813,        # ECB 2023 average 1.0813 USD/EUR (H.10: ~1.082)
    "GBP": 1.2435,        # H.10 2023: ~1.2435 USD/GBP
    "CAD": 1 / 1.3495,    # H.10 2023: ~1.3495 CAD/USD
    "JPY": 1 / 140.49,    # H.10 2023: ~140.49 JPY/USD
    "KRW": 1 / 1306.7,    # H.10 2023: ~1306.7 KRW/USD
    "SGD": 1 / 1.3433,    # H.10 2023: ~1.3433 SGD/USD
    "AUD": 0.6644,        # H.10 2023: ~0.6644 USD/AUD
    "BRL": 1 / 4.9953,    # H.10 2023: ~4.995 BRL/USD
    "INR": 1 / 82.57,     # H.10 2023: ~82.57 INR/USD
    "CLP": 1 / 840.0,     # BCCh dólar observado 2023 average: ~840 CLP/USD
})


def usd_per_unit(currency: str) -> float:
    """USD per one unit of ``currency`` (ISO 4217 code, case-insensitive).

    Raises :class:`UnknownCurrencyError` naming ``currency`` if it is not in the table.
    """
    key = currency.strip().upper() if isinstance(currency, str) else currency
    try:
        return USD_PER_UNIT[key]
    except (KeyError, TypeError):
        raise UnknownCurrencyError(currency, USD_PER_UNIT.keys()) from None


def to_usd(amount: float | np.ndarray, currency: str) -> float | np.ndarray:
    """Convert ``amount`` (a number or array, in ``currency``) to USD at the 2023 reference rate.

    Works for rates too: EUR/MWh in -> USD/MWh out. NaN stays NaN.
    Raises :class:`UnknownCurrencyError` for an unknown currency.
    """
    rate = usd_per_unit(currency)
    if isinstance(amount, np.ndarray):
        return amount * rate
    return float(amount) * rate
