"""Location of the bundled data (``pricing/data``), built by ``scripts/bundle_data.py``.

The product reads only this folder; see ``pricing/data/SOURCES.md`` for the
origin, licence and transformation of every file.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def data_path(name: str) -> Path:
    """Absolute path of bundled file ``name``; raises ``FileNotFoundError`` naming it if absent."""
    p = DATA_DIR / name
    if not p.exists():
        raise FileNotFoundError(f"bundled data file {name!r} missing from {DATA_DIR}; run scripts/bundle_data.py")
    return p
