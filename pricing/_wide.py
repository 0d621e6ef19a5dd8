"""Reader for the bundled wide hourly CSVs (``datetime_utc`` + one column per zone)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd

from pricing._data import data_path


@lru_cache(maxsize=None)
def read_wide(name: str) -> tuple[float, dict[str, np.ndarray]]:
    """Return ``(start_s, {zone: float64 array})`` of bundled file ``name``.

    ``start_s`` is POSIX seconds (UTC) of the first row; rows must be
    consecutive hours (checked). Empty cells become ``NaN``.
    """
    df = pd.read_csv(data_path(name))
    t = pd.to_datetime(df["datetime_utc"], utc=True)
    secs = ((t - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(float)
    if secs.size == 0 or not np.all(np.diff(secs) == 3600.0):
        raise ValueError(f"{name}: datetime_utc is not a consecutive hourly grid")
    cols = {c: df[c].to_numpy(dtype=np.float64) for c in df.columns if c != "datetime_utc"}
    for c in cols.values():
        c.setflags(write=False)
    return float(secs[0]), cols
