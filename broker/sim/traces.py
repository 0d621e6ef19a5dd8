"""Job traces: load historical GPU job submissions for the simulator.

Two loaders produce the same :class:`Trace` of :class:`TraceJob` records:

* :func:`load_philly` — the Microsoft Philly trace as published with the Pollux
  (OSDI'21) artifact, bundled as ``broker/data/philly_jobs_pollux_osdi21.csv.gz``
  (82,247 jobs, 2017-09-04 .. 2017-12-22; provenance and licence in
  ``broker/data/SOURCES.md``). Columns ``timestamp, duration, num_gpus,
  gpu_time, cluster``; ``gpu_time`` is ignored (it is ``duration x num_gpus``).
* :func:`load_generic_csv` — any CSV in the documented schema below.

Rules shared by both loaders
----------------------------

**Instants.** Every ``submit_s`` / ``deadline_s`` is POSIX seconds, UTC.

**Time zone.** Philly timestamps are naive local cluster time; they are read as
wall-clock time in ``site_tz`` (default ``America/Los_Angeles``, the zone of our
default on-prem pool) and converted to UTC. A wall-clock time that occurs twice
(the hour repeated when daylight saving ends) is taken as the *first*
occurrence (daylight time); one that does not exist (the hour skipped when it
starts) is moved forward to the first valid instant.

**Week shift.** Our price and carbon history covers 2023-2024, the Philly trace
2017. To keep the diurnal and weekly pattern of submissions aligned with the
diurnal pattern of prices and carbon, times are shifted by a whole number ``k``
of weeks *in local wall-clock terms*: ``k = ceil((start - first) / 7 days)``
where ``first`` is the local wall-clock time of the earliest valid job and
``start`` the requested start (wall-clock in ``site_tz`` if naive). Every job
keeps its local weekday and hour of day; the first job lands on or after
``start`` (and less than a week after it). ``k`` may be negative. Because the
shift is in wall-clock terms, a job's UTC shift can differ from
``Trace.shift_s = k x 604800`` by the difference in UTC offset (one hour) when
the daylight-saving calendars of the two years differ; for 2017 -> 2023 in
``America/Los_Angeles`` they coincide (both 2017-11-05 and 2023-11-05).
Philly's default ``start`` is 2023-09-04 00:00 (a Monday, like 2017-09-04), so
the trace moves by 313 weeks (2,191 days) to 2023-09-04 .. 2023-12-22.

**Gang shape.** ``num_gpus <= 8`` runs on 1 node with ``num_gpus`` GPUs. Above
8, ``gpus_per_node`` is the largest of 8, 4, 2, 1 that divides ``num_gpus`` and
``nodes = num_gpus / gpus_per_node`` (12 -> 3 x 4, 16 -> 2 x 8, 24 -> 3 x 8,
9 -> 9 x 1). These match 8-GPU servers, the V100 DGX-1 class of the Philly
cluster. More than 1024 nodes is skipped (``gang_too_large``).

**Deadline.** A job without an explicit deadline gets
``deadline = submit + duration + max(slack_factor x duration, min_slack_s)``
(defaults: slack 1 x duration, at least 12 h). Traces record no deadlines; this
gives short jobs a half-day window to be deferred into and long jobs a window
proportional to their length.

**Bad rows** are skipped, never fatal. Each skipped row is counted under the
first failing reason, in this order: ``malformed_row`` (wrong number of
fields), ``duplicate_job_id``, ``bad_job_id`` (starting with ``=``, ``+``, ``-`` or ``@``, which a
spreadsheet opening the output CSVs would run, or holding a control character), ``bad_submit_time``
(also a year outside 1970-2100 or a
relative time beyond two years), ``bad_duration`` (longer than a year, missing,
non-numeric, NaN, infinite, <= 0), ``bad_num_gpus`` (missing, non-integer,
<= 0), ``gang_too_large``, ``unknown_gpu_type`` (checked with
``pricing.power.canonical_gpu_type`` when that module is importable; otherwise
any non-empty string is accepted as is), ``unknown_priority``, ``bad_deadline``
(non-numeric or negative), ``bad_preemptible``, ``bad_team`` (not 1-63
letters, digits, ``.``, ``_`` or ``-``). ``Trace.skipped`` counts rows of the
whole file (also when ``limit`` is given); ``Trace.skip_examples`` keeps up to
3 ``"row N: field=value"`` strings per reason, ``N`` the 1-based data row
(file line ``N + 1``).

Generic CSV schema (header names are case-insensitive)
------------------------------------------------------

=============  ========  ==========================================================
column         required  meaning
=============  ========  ==========================================================
submit_time    yes       ISO 8601 (``2023-09-04T10:30:00Z``, ``...+02:00``, or
                         naive = wall-clock in ``site_tz``, default UTC), **or**
                         plain seconds from the trace start (anchored at ``start``,
                         or at 2023-09-04 00:00 ``site_tz`` without one; never
                         week-shifted)
duration_s     yes       runtime on the reference GPU (V100), seconds, > 0
num_gpus       yes       GPUs of the whole job, integer >= 1
gpu_type       no        required GPU type; empty = any
team           no        owning team; empty = ``default``
priority       no        low / normal / high / critical; empty = normal
deadline_s     no        seconds after submission; empty = the deadline rule
preemptible    no        true/false/1/0/yes/no; empty = false
job_id         no        unique id; empty = ``job-<N>``
=============  ========  ==========================================================

Philly jobs get ``team`` = the ``cluster`` column (anonymised virtual cluster),
``gpu_type=None`` (the trace does not say; the Philly cluster's GPUs were V100
class, which is also our reference GPU for ``duration_s``), priority ``normal``,
``preemptible=False`` and ``job_id = "philly-<N>"``.

Errors: :class:`TraceError` (a ``ValueError``) for an unreadable file, a
missing required column, an unknown ``site_tz`` or a bad argument; it names the
path, column or argument.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pandas as pd

from broker import DATA_DIR
from broker.model import (DEFAULT_MIN_SLACK_S, DEFAULT_SLACK_FACTOR, MAX_NODES, TEAM_RE, WEEK_S, PriorityClass,
                          default_slack_s)

#: a job id a spreadsheet would run (a cell starting with = + - @) or holding a control character (the C0/C1
#: ranges of :data:`broker.model.CONTROL_CHAR_RE`): skipped as ``bad_job_id``
_UNSAFE_ID = re.compile(r"^[=+\-@]|[\x00-\x1f\x7f-\x9f]")

__all__ = [
    "TraceError",
    "TraceJob",
    "Trace",
    "load_philly",
    "load_generic_csv",
    "gang_shape",
    "default_deadline_s",
    "PHILLY_PATH",
    "PHILLY_DEFAULT_START",
    "WEEK_S",
]

#: Bundled Philly trace (Pollux OSDI'21 artifact), see ``broker/data/SOURCES.md``.
PHILLY_PATH = DATA_DIR / "philly_jobs_pollux_osdi21.csv.gz"
#: Default start for the Philly week shift: a Monday, like the trace's first day 2017-09-04.
PHILLY_DEFAULT_START = datetime(2023, 9, 4)
_WEEK_NS = int(WEEK_S) * 10**9
_NAME_RE = TEAM_RE  # team names
_MAX_NODES = MAX_NODES  # JobSpec.nodes upper bound
_TRUE = {"true", "1", "yes", "y", "t"}
_FALSE = {"false", "0", "no", "n", "f", ""}
_PRIORITIES = {p.value: p for p in PriorityClass}


#: longest accepted job duration: one year, s (Philly's longest is 53.6 days). Longer rows are
#: skipped as ``bad_duration``: they cannot be costed against two years of signal data.
MAX_DURATION_S = 366 * 86400.0
#: latest accepted relative ``submit_time`` (seconds from the trace start): two years, s.
MAX_TRACE_SPAN_S = 2 * 366 * 86400.0


class TraceError(ValueError):
    """A trace could not be loaded: names the path, column or argument."""


@dataclass(slots=True)
class TraceJob:
    """One job of a trace.

    Attributes:
        job_id: unique id within the trace.
        submit_s: submission instant, POSIX seconds UTC (after the week shift).
        duration_s: runtime on the reference GPU (V100), seconds (> 0).
        num_gpus: GPUs of the whole gang (``nodes x gpus_per_node``).
        gpus_per_node: GPUs on each node (see the gang-shape rule).
        nodes: nodes of the gang.
        gpu_type: required GPU type, or ``None`` for any.
        team: owning team (Philly: the virtual cluster id).
        priority: queue priority class.
        deadline_s: latest completion instant, POSIX seconds UTC.
        preemptible: may be preempted by higher-priority work.
    """

    job_id: str
    submit_s: float
    duration_s: float
    num_gpus: int
    gpus_per_node: int
    nodes: int
    gpu_type: str | None
    team: str
    priority: PriorityClass
    deadline_s: float
    preemptible: bool


@dataclass
class Trace:
    """A loaded trace.

    Attributes:
        jobs: valid jobs sorted by ``submit_s`` (ties in file order).
        skipped: reason -> number of rows skipped (whole file).
        skip_examples: reason -> up to 3 ``"row N: field=value"`` strings.
        shift_s: the week shift applied, seconds (``k x 604800``; 0 if none).
        source: where the trace came from (the file path).
    """

    jobs: list[TraceJob]
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    shift_s: float = 0.0
    source: str = ""

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def total_skipped(self) -> int:
        """Rows skipped, all reasons together."""
        return sum(self.skipped.values())


# --------------------------------------------------------------------------- rules


def gang_shape(num_gpus: int) -> tuple[int, int]:
    """Return ``(nodes, gpus_per_node)`` for a job of ``num_gpus`` GPUs (>= 1).

    ``<= 8`` GPUs: one node. Above: ``gpus_per_node`` is the largest of 8, 4, 2, 1
    dividing ``num_gpus``. Raises :class:`TraceError` for ``num_gpus < 1``.
    """
    n = int(num_gpus)
    if n < 1:
        raise TraceError(f"num_gpus={num_gpus!r}: must be >= 1")
    if n <= 8:
        return 1, n
    for per in (8, 4, 2, 1):
        if n % per == 0:
            return n // per, per
    raise AssertionError("unreachable")  # pragma: no cover


def default_deadline_s(submit_s: float, duration_s: float, slack_factor: float = DEFAULT_SLACK_FACTOR,
                       min_slack_s: float = DEFAULT_MIN_SLACK_S) -> float:
    """Deadline (POSIX s) for a job without one: ``submit + duration + max(slack_factor x duration, min_slack_s)``."""
    return submit_s + duration_s + default_slack_s(duration_s, slack_factor, min_slack_s)


# --------------------------------------------------------------------------- reading


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, "rt", encoding="utf-8-sig", newline="")


def _read_table(path: Path, required: Iterable[str], optional: Iterable[str]) -> tuple[dict[str, np.ndarray], np.ndarray, list[int]]:
    """Read a CSV into ``column -> object array of str``; returns (columns, row numbers, malformed row numbers)."""
    required = list(required)
    wanted = required + list(optional)
    try:
        with _open_text(path) as fh:
            reader = csv.reader(fh)
            try:
                header = next(reader)
            except StopIteration:
                raise TraceError(f"{path}: empty file (no header)") from None
            names = [h.strip().lower() for h in header]
            missing = [c for c in required if c not in names]
            if missing:
                raise TraceError(f"{path}: missing required column(s) {', '.join(missing)} (header: {', '.join(names)})")
            idx = {c: names.index(c) for c in wanted if c in names}
            width = len(names)
            cols: dict[str, list[str]] = {c: [] for c in idx}
            rows: list[int] = []
            bad: list[int] = []
            n = 0
            items = list(idx.items())
            for rec in reader:
                if not rec or (len(rec) == 1 and not rec[0].strip()):
                    continue  # blank line
                n += 1
                if len(rec) != width:
                    bad.append(n)
                    continue
                rows.append(n)
                for c, i in items:
                    cols[c].append(rec[i])
    except TraceError:
        raise
    except (OSError, UnicodeDecodeError, EOFError, csv.Error, gzip.BadGzipFile) as e:
        raise TraceError(f"{path}: cannot read trace: {e}") from e
    out = {c: np.array(v, dtype=object) for c, v in cols.items()}
    return out, np.array(rows, dtype=np.int64), bad


# --------------------------------------------------------------------------- validation


class _Checker:
    """Applies skip rules in order; the first failing rule of a row wins."""

    def __init__(self, rows: np.ndarray, cols: dict[str, np.ndarray]):
        self.rows = rows
        self.cols = cols
        self.ok = np.ones(len(rows), dtype=bool)
        self.skipped: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, count: int, examples: list[str]) -> None:
        if count:
            self.skipped[reason] = self.skipped.get(reason, 0) + count
            ex = self.examples.setdefault(reason, [])
            ex.extend(examples[: 3 - len(ex)])

    def flag(self, bad: np.ndarray, reason: str, fld: str, col: str | None = None) -> None:
        new = bad & self.ok
        cnt = int(new.sum())
        if not cnt:
            return
        where = np.flatnonzero(new)[:3]
        raw = self.cols.get(col or fld)
        ex = []
        for i in where:
            v = raw[i] if raw is not None else ""
            ex.append(f"row {self.rows[i]}: {fld}={v if str(v).strip() else repr(v)}")
        self.add(reason, cnt, ex)
        self.ok &= ~new


def _numeric(values: np.ndarray) -> np.ndarray:
    return pd.to_numeric(pd.Series(values, dtype=object).str.strip(), errors="coerce").to_numpy(dtype=float)


def _gpu_canonicalizer() -> Callable[[str], str | None]:
    """``pricing.power.canonical_gpu_type`` if importable (None/raise = unknown), else identity."""
    try:
        from pricing.power import canonical_gpu_type  # type: ignore[import-not-found]
    except Exception:  # absent or broken module: accept any string
        return lambda s: s

    def canon(s: str) -> str | None:
        try:
            out = canonical_gpu_type(s)
        except Exception:
            return None
        return str(out) if out else None

    return canon


def _zone(site_tz: str) -> ZoneInfo:
    try:
        return ZoneInfo(site_tz)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as e:
        raise TraceError(f"site_tz={site_tz!r}: unknown time zone") from e


def _wall_ns(dt: datetime, tz: ZoneInfo) -> int:
    """Local wall-clock time of ``dt`` in ``tz`` as naive ns (naive ``dt`` is already wall-clock)."""
    if dt.tzinfo is not None:
        dt = dt.astimezone(tz).replace(tzinfo=None)
    return pd.Timestamp(dt).value


def _localize_ns(naive_ns: np.ndarray, tz: ZoneInfo) -> np.ndarray:
    """Naive wall-clock ns in ``tz`` -> UTC POSIX seconds (ambiguous: first occurrence; nonexistent: forward)."""
    if len(naive_ns) == 0:
        return np.zeros(0)
    idx = pd.DatetimeIndex(naive_ns.astype("datetime64[ns]"))
    if str(tz) != "UTC":
        idx = idx.tz_localize(tz, ambiguous=np.ones(len(idx), dtype=bool), nonexistent="shift_forward")
    ns = idx.as_unit("ns").asi8
    return (ns // 10**9).astype(float) + (ns % 10**9) / 1e9


def _utc_to_wall_ns(utc_s: np.ndarray, tz: ZoneInfo) -> np.ndarray:
    idx = pd.to_datetime(np.round(utc_s * 1e6).astype(np.int64), unit="us", utc=True)
    return idx.tz_convert(tz).tz_localize(None).as_unit("ns").asi8


def _week_shift(first_wall_ns: int, start: datetime, tz: ZoneInfo) -> int:
    """Whole weeks ``k`` so that ``first + k weeks`` is the first such time on/after ``start`` (wall-clock)."""
    diff = _wall_ns(start, tz) - first_wall_ns
    return -((-diff) // _WEEK_NS)  # ceil division on ints


def _check_common(chk: _Checker, cols: dict[str, np.ndarray], n: int, *, generic: bool,
                  gpu_canon: Callable[[str], str | None]) -> dict[str, np.ndarray]:
    """Validate duration, GPUs and the optional columns; returns parsed arrays."""
    dur = _numeric(cols["duration_s"] if generic else cols["duration"])
    chk.flag(~(np.isfinite(dur) & (dur > 0) & (dur <= MAX_DURATION_S)), "bad_duration",
             "duration_s" if generic else "duration")

    g = _numeric(cols["num_gpus"])
    good_g = np.isfinite(g) & (g >= 1) & (np.floor(np.where(np.isfinite(g), g, 0)) == g)
    chk.flag(~good_g, "bad_num_gpus", "num_gpus")
    gi = np.where(good_g, g, 1).astype(np.int64)
    per = np.ones(n, dtype=np.int64)
    for p in (1, 2, 4, 8):
        per = np.where(gi % p == 0, p, per)
    per = np.where(gi <= 8, gi, per)
    nodes = gi // per
    chk.flag(nodes > _MAX_NODES, "gang_too_large", "num_gpus")

    out = {"duration": dur, "gpus": gi, "per": per, "nodes": nodes}

    if not generic:
        return out

    # gpu_type
    gt = cols.get("gpu_type")
    gtypes = np.full(n, None, dtype=object)
    if gt is not None:
        cache: dict[str, str | None] = {}
        bad = np.zeros(n, dtype=bool)
        for i, raw in enumerate(gt):
            s = raw.strip()
            if not s:
                continue
            if s not in cache:
                cache[s] = gpu_canon(s)
            c = cache[s]
            if c is None:
                bad[i] = True
            gtypes[i] = c
        chk.flag(bad, "unknown_gpu_type", "gpu_type")
    out["gpu_type"] = gtypes

    # priority
    pr = cols.get("priority")
    prio = np.empty(n, dtype=object)
    prio.fill(PriorityClass.normal)  # np.full would coerce the str-enum to a numpy string
    if pr is not None:
        bad = np.zeros(n, dtype=bool)
        for i, raw in enumerate(pr):
            s = raw.strip().lower()
            if not s:
                continue
            p = _PRIORITIES.get(s)
            if p is None:
                bad[i] = True
            else:
                prio[i] = p
        chk.flag(bad, "unknown_priority", "priority")
    out["priority"] = prio

    # deadline (relative seconds)
    dl = cols.get("deadline_s")
    rel = np.full(n, np.nan)
    if dl is not None:
        empty = np.array([not s.strip() for s in dl], dtype=bool)
        rel = _numeric(dl)
        chk.flag(~empty & ~(np.isfinite(rel) & (rel >= 0)), "bad_deadline", "deadline_s")
        rel = np.where(empty, np.nan, rel)
    out["deadline_rel"] = rel

    # preemptible
    pe = cols.get("preemptible")
    pre = np.zeros(n, dtype=bool)
    if pe is not None:
        bad = np.zeros(n, dtype=bool)
        for i, raw in enumerate(pe):
            s = raw.strip().lower()
            if s in _TRUE:
                pre[i] = True
            elif s not in _FALSE:
                bad[i] = True
        chk.flag(bad, "bad_preemptible", "preemptible")
    out["preemptible"] = pre

    # team
    out["team"] = _check_team(chk, cols.get("team"), n, "team")
    return out


def _check_team(chk: _Checker, col: np.ndarray | None, n: int, fld: str) -> np.ndarray:
    if col is None:
        return np.full(n, "default", dtype=object)
    teams = np.array([s.strip() or "default" for s in col], dtype=object)
    cache: dict[str, bool] = {}
    bad = np.zeros(n, dtype=bool)
    for i, t in enumerate(teams):
        ok = cache.get(t)
        if ok is None:
            ok = cache[t] = bool(_NAME_RE.match(t))
        bad[i] = not ok
    chk.flag(bad, "bad_team", fld, col=fld if fld in chk.cols else None)
    return teams


def _assemble(*, ids: np.ndarray, submit: np.ndarray, parsed: dict[str, np.ndarray], ok: np.ndarray,
              rows: np.ndarray, limit: int | None, slack_factor: float, min_slack_s: float) -> list[TraceJob]:
    sel = np.flatnonzero(ok)
    order = sel[np.lexsort((rows[sel], submit[sel]))]
    if limit is not None:
        order = order[:limit]
    dur = parsed["duration"]
    rel = parsed.get("deadline_rel")
    gtype = parsed.get("gpu_type")
    prio = parsed.get("priority")
    pre = parsed.get("preemptible")
    team = parsed["team"]
    jobs: list[TraceJob] = []
    normal = PriorityClass.normal
    for i in order.tolist():
        s = float(submit[i])
        d = float(dur[i])
        r = float(rel[i]) if rel is not None else math.nan
        deadline = s + r if r == r else s + d + default_slack_s(d, slack_factor, min_slack_s)
        jobs.append(TraceJob(
            job_id=str(ids[i]),
            submit_s=s,
            duration_s=d,
            num_gpus=int(parsed["gpus"][i]),
            gpus_per_node=int(parsed["per"][i]),
            nodes=int(parsed["nodes"][i]),
            gpu_type=gtype[i] if gtype is not None else None,
            team=str(team[i]),
            priority=prio[i] if prio is not None else normal,
            deadline_s=deadline,
            preemptible=bool(pre[i]) if pre is not None else False,
        ))
    return jobs


def _check_args(limit: int | None, slack_factor: float, min_slack_s: float) -> None:
    if limit is not None and (not isinstance(limit, (int, np.integer)) or limit < 0):
        raise TraceError(f"limit={limit!r}: must be an integer >= 0 or None")
    if not (math.isfinite(slack_factor) and slack_factor >= 0):
        raise TraceError(f"slack_factor={slack_factor!r}: must be finite and >= 0")
    if not (math.isfinite(min_slack_s) and min_slack_s >= 0):
        raise TraceError(f"min_slack_s={min_slack_s!r}: must be finite and >= 0")


# --------------------------------------------------------------------------- loaders


def load_philly(path: str | Path | None = None, *, start: datetime | None = None, limit: int | None = None,
                slack_factor: float = DEFAULT_SLACK_FACTOR, min_slack_s: float = DEFAULT_MIN_SLACK_S,
                site_tz: str = "America/Los_Angeles") -> Trace:
    """Load the Philly trace (Pollux OSDI'21 CSV) and shift it onto 2023.

    Args:
        path: CSV or CSV.gz with columns ``timestamp, duration, num_gpus, cluster``;
            default the bundled :data:`PHILLY_PATH`.
        start: earliest allowed first submission after the week shift (naive = wall-clock
            in ``site_tz``); default :data:`PHILLY_DEFAULT_START` (2023-09-04 00:00).
        limit: keep only the first ``limit`` valid jobs in submit order.
        slack_factor, min_slack_s: the deadline rule (module docstring).
        site_tz: IANA zone the naive timestamps are wall-clock in.

    Returns:
        :class:`Trace` with jobs sorted by ``submit_s`` (POSIX s UTC); see the module
        docstring for the field mapping, time-zone and week-shift rules.

    Raises:
        TraceError: unreadable file, missing column, unknown ``site_tz``, bad argument.
    """
    _check_args(limit, slack_factor, min_slack_s)
    tz = _zone(site_tz)
    p = Path(path) if path is not None else PHILLY_PATH
    cols, rows, malformed = _read_table(p, ["timestamp", "duration", "num_gpus", "cluster"], [])
    n = len(rows)
    chk = _Checker(rows, cols)
    if malformed:
        chk.add("malformed_row", len(malformed), [f"row {r}: fields=wrong count" for r in malformed[:3]])

    wall = pd.to_datetime(pd.Series(cols["timestamp"], dtype=object).str.strip(),
                          format="%Y-%m-%d %H:%M:%S", errors="coerce")
    wall_ns = wall.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    chk.flag(wall.isna().to_numpy(), "bad_submit_time", "timestamp")
    parsed = _check_common(chk, cols, n, generic=False, gpu_canon=lambda s: s)
    parsed["team"] = _check_team(chk, cols["cluster"], n, "cluster")

    ok = chk.ok
    k = 0
    submit = np.full(n, np.nan)
    if ok.any():
        k = _week_shift(int(wall_ns[ok].min()), start if start is not None else PHILLY_DEFAULT_START, tz)
        submit[ok] = _localize_ns(wall_ns[ok] + k * _WEEK_NS, tz)
    ids = np.array([f"philly-{r}" for r in rows.tolist()], dtype=object)
    jobs = _assemble(ids=ids, submit=submit, parsed=parsed, ok=ok, rows=rows, limit=limit,
                     slack_factor=slack_factor, min_slack_s=min_slack_s)
    return Trace(jobs=jobs, skipped=chk.skipped, skip_examples=chk.examples, shift_s=float(k * WEEK_S), source=str(p))


def _parse_submit(raw: str, tz: ZoneInfo) -> tuple[int, float]:
    """-> (kind, value): kind 0 bad, 1 absolute UTC POSIX s, 2 seconds from trace start."""
    s = raw.strip()
    if not s:
        return 0, math.nan
    try:
        x = float(s)
    except ValueError:
        pass
    else:  # seconds from the trace start: at most MAX_TRACE_SPAN_S
        return (2, x) if math.isfinite(x) and 0 <= x <= MAX_TRACE_SPAN_S else (0, math.nan)
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        return 0, math.nan
    if not 1970 <= dt.year <= 2100:
        return 0, math.nan
    if dt.tzinfo is None:
        # naive: wall-clock in site_tz (first occurrence if ambiguous)
        return 1, float(_localize_ns(np.array([pd.Timestamp(dt).value], dtype=np.int64), tz)[0])
    return 1, dt.timestamp()


def load_generic_csv(path: str | Path, *, start: datetime | None = None, limit: int | None = None,
                     slack_factor: float = DEFAULT_SLACK_FACTOR, min_slack_s: float = DEFAULT_MIN_SLACK_S, site_tz: str = "UTC") -> Trace:
    """Load a trace in the generic CSV schema (module docstring).

    Args:
        path: CSV or CSV.gz file.
        start: if given, shift absolute submit times by whole weeks (wall-clock in
            ``site_tz``) so the first lands on/after ``start``; also the anchor of
            relative (plain-seconds) submit times. Without it times are kept.
        limit: keep only the first ``limit`` valid jobs in submit order.
        slack_factor, min_slack_s: the deadline rule for rows without ``deadline_s``.
        site_tz: IANA zone of naive ISO times and of the week shift (default UTC).

    Returns:
        :class:`Trace`, jobs sorted by ``submit_s`` (POSIX s UTC).

    Raises:
        TraceError: unreadable file, missing required column, unknown ``site_tz``, bad argument.
    """
    _check_args(limit, slack_factor, min_slack_s)
    tz = _zone(site_tz)
    p = Path(path)
    cols, rows, malformed = _read_table(
        p, ["submit_time", "duration_s", "num_gpus"],
        ["gpu_type", "team", "priority", "deadline_s", "preemptible", "job_id"])
    n = len(rows)
    chk = _Checker(rows, cols)
    if malformed:
        chk.add("malformed_row", len(malformed), [f"row {r}: fields=wrong count" for r in malformed[:3]])

    # ids and duplicates
    if "job_id" in cols:
        ids = np.array([s.strip() or f"job-{r}" for s, r in zip(cols["job_id"], rows.tolist())], dtype=object)
    else:
        ids = np.array([f"job-{r}" for r in rows.tolist()], dtype=object)
    seen: set[str] = set()
    dup = np.zeros(n, dtype=bool)
    for i, j in enumerate(ids):
        if j in seen:
            dup[i] = True
        seen.add(j)
    chk.flag(dup, "duplicate_job_id", "job_id")
    # an id a spreadsheet would run (a cell starting with = + - @: CSV injection) or a terminal would act on
    # reaches jobs-*.csv, the usage files and the report as it is
    unsafe = _UNSAFE_ID.search
    chk.flag(np.fromiter((unsafe(j) is not None for j in ids), dtype=bool, count=n), "bad_job_id", "job_id")

    kind = np.zeros(n, dtype=np.int8)
    val = np.full(n, np.nan)
    for i, raw in enumerate(cols["submit_time"]):
        kind[i], val[i] = _parse_submit(raw, tz)
    chk.flag(kind == 0, "bad_submit_time", "submit_time")
    parsed = _check_common(chk, cols, n, generic=True, gpu_canon=_gpu_canonicalizer())

    ok = chk.ok
    submit = np.full(n, np.nan)
    absm = ok & (kind == 1)
    relm = ok & (kind == 2)
    k = 0
    if absm.any():
        submit[absm] = val[absm]
        if start is not None:
            wall = _utc_to_wall_ns(val[absm], tz)
            k = _week_shift(int(wall.min()), start, tz)
            if k:
                submit[absm] = _localize_ns(wall + k * _WEEK_NS, tz)
    if relm.any():
        anchor = start if start is not None else PHILLY_DEFAULT_START
        anchor_s = anchor.timestamp() if anchor.tzinfo is not None else float(
            _localize_ns(np.array([pd.Timestamp(anchor).value], dtype=np.int64), tz)[0])
        submit[relm] = anchor_s + val[relm]
    jobs = _assemble(ids=ids, submit=submit, parsed=parsed, ok=ok, rows=rows, limit=limit,
                     slack_factor=slack_factor, min_slack_s=min_slack_s)
    return Trace(jobs=jobs, skipped=chk.skipped, skip_examples=chk.examples, shift_s=float(k * WEEK_S), source=str(p))
