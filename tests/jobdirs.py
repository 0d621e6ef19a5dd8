"""A ``tmp_path`` that jobs can reach, for the tests that run real jobs (tests/workers, tests/e2e).

Jobs never run as root (:mod:`workers.isolation`): when the tests run as root, every job runs
as an unprivileged uid (its own per attempt, or ``nobody``), which cannot enter pytest's own temporary directories (``/tmp/pytest-of-root`` is
mode 0700). The side-effect files tests share with their jobs therefore live in a fresh
directory under ``/tmp`` of mode 1777 (anyone may create files, only their owner may remove them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def tmp_path():
    """A fresh directory of mode 1777 under ``/tmp`` (replaces pytest's ``tmp_path``); removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="fedbroker-test-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)
