"""Machine and code description recorded with every benchmark result."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

__all__ = ["machine_info", "code_version", "parse_policies"]


def machine_info() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), **code_version()}


def code_version() -> dict:
    """Git HEAD plus a hash of the broker/ and pricing/ sources as measured (the tree may be dirty)."""
    import hashlib
    import subprocess

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(list((root / "broker").glob("*.py")) + list((root / "pricing").glob("*.py"))):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "broker", "pricing"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", None
    return {"git_head": head, "src_dirty": dirty, "src_sha256": h.hexdigest()[:12]}


def parse_policies(ap, text: str) -> list[str]:
    """Comma-separated policy names from ``--policies``; ``ap.error`` (exit 2) names unknown ones."""
    from broker.planner.core import POLICY_NAMES

    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        ap.error(f"--policies: unknown {bad or 'empty'}; choose from {', '.join(POLICY_NAMES)}")
    return policies
