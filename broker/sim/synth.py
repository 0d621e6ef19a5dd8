"""Seeded synthetic job traces in the generic CSV schema (README "Generic trace schema").

Usage::

    python -m broker.sim.synth gangs OUT.csv [--seed 0] [--days 14] [--load 1.0] ...
    python -m broker.sim.synth short OUT.csv [--seed 0] [--days 2] [--load 0.8] ...

then ``fedbroker simulate --trace OUT.csv ...``. Same arguments -> byte-identical file (NumPy
``default_rng(seed)``, fixed column order, times rounded to whole seconds). The files are not
bundled: they are small and made in about a second.

Columns written: ``job_id, submit_time, duration_s, num_gpus, team``. ``submit_time`` is ISO 8601 UTC
(``...Z``); ``duration_s`` whole seconds on the reference V100, as in the schema; no ``deadline_s``, so
the loader gives every job the default deadline rule ``submit + duration + max(duration, 12 h)``
(``broker.model.default_slack_s``); no ``gpu_type`` (any GPU), priority normal, not preemptible.
``num_gpus`` above 8 is a gang of ``num_gpus / 8`` nodes x 8 GPUs (``broker.sim.traces.gang_shape``).

The two kinds (every number below is an assumption of this generator, chosen to stress one side of
the planner, not a fit to a measured trace):

``gangs`` -- large multi-node training gangs.
    * size: 128 GPUs (16 nodes x 8) with probability 0.6, 64 (8 x 8) 0.25, 16 (2 x 8) 0.15
      (``GANG_MIX``); the largest is a third of the default 384-GPU pool (48 nodes x 8 V100).
    * duration: log-normal, median 4 h, sigma 0.8 (mean 5.5 h), clipped to [30 min, 48 h].
    * arrivals: Poisson over ``--days`` days (default 14) with a diurnal rate (below).

``short`` -- short jobs (minutes), many of them.
    * size: 1 GPU 0.55, 2 GPUs 0.20, 4 GPUs 0.15, 8 GPUs (one node) 0.10 (``SHORT_MIX``).
    * duration: log-normal, median 8 min, sigma 1.0 (mean 13.2 min), clipped to [1 min, 2 h].
    * arrivals: Poisson over ``--days`` days (default 2) with a diurnal rate (below).

Arrival rate. ``--load`` is the offered load as a fraction of ``--pool-gpus`` GPUs (default 384, the
default cluster): the mean rate is ``load x pool_gpus / E[num_gpus x duration_h]`` jobs per hour, with
the mean of the unclipped log-normal, ``exp(mu + sigma^2 / 2)`` (the clipping changes it by < 1 %
for these parameters). The rate swings by ``--diurnal`` (amplitude, default 0.5) around that mean as
``1 + diurnal x cos(2 pi (hour_utc - 15) / 24)``, a peak at 15:00 UTC (11:00 in Toronto, the default
site): drawn by thinning a homogeneous Poisson process at the peak rate. The offered load and the job
count are printed after writing.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from broker.utc import iso_z

#: (num_gpus, probability) of the ``gangs`` kind: 16 x 8, 8 x 8 and 2 x 8 GPU gangs.
GANG_MIX: tuple[tuple[int, float], ...] = ((128, 0.60), (64, 0.25), (16, 0.15))
#: (num_gpus, probability) of the ``short`` kind: single-node jobs.
SHORT_MIX: tuple[tuple[int, float], ...] = ((1, 0.55), (2, 0.20), (4, 0.15), (8, 0.10))
#: teams the jobs are spread over uniformly (fair share has something to share).
TEAMS: tuple[str, ...] = ("team-a", "team-b", "team-c", "team-d")
#: hour of day (UTC) of the arrival-rate peak: 15:00 UTC = 11:00 EDT at the default Toronto site.
PEAK_HOUR_UTC = 15.0
#: trace start, UTC: a Monday, the default start of the Philly replay.
DEFAULT_START = datetime(2023, 9, 4, tzinfo=timezone.utc)
#: default pool size the offered load refers to: 48 nodes x 8 V100 (broker/data/default_cluster.yaml).
DEFAULT_POOL_GPUS = 384


@dataclass(frozen=True)
class Kind:
    """One trace kind: GPU mix and log-normal duration (median s, sigma, clip [lo, hi] s)."""

    mix: tuple[tuple[int, float], ...]
    median_s: float
    sigma: float
    min_s: float
    max_s: float
    days: float
    load: float


KINDS: dict[str, Kind] = {
    "gangs": Kind(GANG_MIX, median_s=4 * 3600.0, sigma=0.8, min_s=1800.0, max_s=48 * 3600.0, days=14.0, load=1.0),
    "short": Kind(SHORT_MIX, median_s=8 * 60.0, sigma=1.0, min_s=60.0, max_s=2 * 3600.0, days=2.0, load=0.8),
}

COLUMNS = ("job_id", "submit_time", "duration_s", "num_gpus", "team")


def mean_rate_per_h(kind: Kind, load: float, pool_gpus: int) -> float:
    """Mean arrivals per hour for an offered load ``load`` (fraction of ``pool_gpus`` GPUs busy)."""
    gpus = np.array([g for g, _ in kind.mix], dtype=float)
    prob = np.array([p for _, p in kind.mix], dtype=float)
    mean_dur_h = kind.median_s * math.exp(kind.sigma ** 2 / 2) / 3600.0
    return load * pool_gpus / (float(gpus @ prob) * mean_dur_h)


def generate(kind_name: str, *, seed: int = 0, days: float | None = None, load: float | None = None,
             pool_gpus: int = DEFAULT_POOL_GPUS, diurnal: float = 0.5,
             start: datetime = DEFAULT_START) -> list[dict[str, str]]:
    """The rows of a trace of kind ``kind_name`` (``gangs`` or ``short``), in submit order.

    Args:
        kind_name: ``gangs`` or ``short`` (module docstring).
        seed: NumPy ``default_rng`` seed; same arguments -> same rows.
        days: span of the arrivals, days (> 0); default the kind's.
        load: offered load, fraction of ``pool_gpus`` (> 0); default the kind's.
        pool_gpus: GPUs the load refers to (>= 1).
        diurnal: amplitude of the daily rate swing, in [0, 1].
        start: first instant of the trace (timezone-aware).

    Raises:
        ValueError: naming the argument and value.
    """
    if kind_name not in KINDS:
        raise ValueError(f"kind={kind_name!r}: choose from {', '.join(KINDS)}")
    kind = KINDS[kind_name]
    days = kind.days if days is None else float(days)
    load = kind.load if load is None else float(load)
    if not (math.isfinite(days) and 0 < days <= 366):
        raise ValueError(f"days={days!r}: must be in (0, 366]")
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"load={load!r}: must be > 0")
    if pool_gpus < 1:
        raise ValueError(f"pool_gpus={pool_gpus!r}: must be >= 1")
    if not (0 <= diurnal <= 1):
        raise ValueError(f"diurnal={diurnal!r}: must be in [0, 1]")
    if start.tzinfo is None:
        raise ValueError(f"start={start!r}: must be timezone-aware")
    if seed < 0:
        raise ValueError(f"seed={seed!r}: must be >= 0")

    rng = np.random.default_rng(seed)
    span_s = days * 86400.0
    peak_per_s = mean_rate_per_h(kind, load, pool_gpus) * (1 + diurnal) / 3600.0
    if peak_per_s * span_s > MAX_JOBS:
        raise ValueError(f"load={load:g}, pool_gpus={pool_gpus}, days={days:g}: about {peak_per_s * span_s:,.0f} "
                         f"arrivals to draw, more than {MAX_JOBS:,}: lower one of them")
    n = rng.poisson(peak_per_s * span_s)
    t = np.sort(rng.uniform(0.0, span_s, n))
    hour = ((start.timestamp() + t) / 3600.0) % 24.0
    accept = rng.uniform(0.0, 1.0, n) * (1 + diurnal) < 1 + diurnal * np.cos(2 * np.pi * (hour - PEAK_HOUR_UTC) / 24)
    t = t[accept]
    m = len(t)
    gpus = np.array([g for g, _ in kind.mix])[rng.choice(len(kind.mix), size=m, p=[p for _, p in kind.mix])]
    dur = np.clip(np.rint(kind.median_s * np.exp(kind.sigma * rng.standard_normal(m))), kind.min_s, kind.max_s)
    teams = rng.integers(0, len(TEAMS), size=m)
    t0 = start.timestamp()
    rows = []
    for i in range(m):
        rows.append({"job_id": f"{kind_name}-{i}", "submit_time": iso_z(round(t0 + t[i])),
                     "duration_s": str(int(dur[i])), "num_gpus": str(int(gpus[i])), "team": TEAMS[teams[i]]})
    return rows


#: most arrivals :func:`generate` draws (about 1 GB of rows in memory; the Philly trace has 82,247 jobs)
MAX_JOBS = 2_000_000
#: generate()'s argument names as main()'s options, for error messages
_FLAGS = {"days=": "--days=", "load=": "--load=", "pool_gpus=": "--pool-gpus=", "diurnal=": "--diurnal=",
          "seed=": "--seed=", "start=": "--start="}


def write_csv(rows: list[dict[str, str]], path: Path) -> None:
    """Write ``rows`` as CSV with the header :data:`COLUMNS` (LF line ends)."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def offered_load(rows: list[dict[str, str]], days: float, pool_gpus: int) -> float:
    """GPU-hours asked for by ``rows`` over the GPU-hours of ``pool_gpus`` GPUs in ``days`` days."""
    gpu_h = sum(int(r["num_gpus"]) * int(r["duration_s"]) for r in rows) / 3600.0
    return gpu_h / (pool_gpus * days * 24.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("out", type=Path, help="CSV file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--days", type=float, default=None, help="span of arrivals, days (gangs 14, short 2)")
    ap.add_argument("--load", type=float, default=None, help="offered load, fraction of --pool-gpus (gangs 1.0, short 0.8)")
    ap.add_argument("--pool-gpus", type=int, default=DEFAULT_POOL_GPUS)
    ap.add_argument("--diurnal", type=float, default=0.5, help="amplitude of the daily arrival-rate swing, 0..1")
    ap.add_argument("--start", default="2023-09-04", help="first day, UTC (ISO date)")
    a = ap.parse_args(argv)
    if a.out.is_dir() or not a.out.parent.is_dir():
        print(f"error: out={str(a.out)!r}: " + ("is a directory" if a.out.is_dir() else "its folder does not exist"),
              file=sys.stderr)
        return 2
    try:
        start = datetime.fromisoformat(a.start)
    except ValueError:
        print(f"error: --start={a.start!r}: not an ISO 8601 date or instant (e.g. 2023-09-04)", file=sys.stderr)
        return 2
    try:
        start = start if start.tzinfo else start.replace(tzinfo=timezone.utc)
        rows = generate(a.kind, seed=a.seed, days=a.days, load=a.load, pool_gpus=a.pool_gpus, diurnal=a.diurnal,
                        start=start)
    except ValueError as e:
        msg = str(e)
        for arg, flag in _FLAGS.items():
            msg = msg.replace(arg, flag)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if not rows:
        print("error: no job arrived in the span: raise --days or --load", file=sys.stderr)
        return 2
    try:
        write_csv(rows, a.out)
    except OSError as e:
        print(f"error: out={str(a.out)!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    days = KINDS[a.kind].days if a.days is None else a.days
    print(f"{a.out}: {len(rows)} jobs, offered load {offered_load(rows, days, a.pool_gpus):.2f} of {a.pool_gpus} GPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
