"""A/B of the generic trace loader (:func:`broker.sim.traces.load_generic_csv`): ``--base REV``'s
``broker/sim/traces.py`` against the working tree's, interleaved in one process, on a synthetic trace of
``--rows`` rows (seed 0). Prints each run's seconds and the ratio of the best runs (new / base).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_trace_load.py --base afd13df --rows 200000 --reps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from broker.sim import traces as new

    d = Path(tempfile.mkdtemp())
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{a.base}:broker/sim/traces.py"], capture_output=True,
                         text=True, check=True).stdout
    (d / "traces_base.py").write_text(src)
    spec = importlib.util.spec_from_file_location("broker.sim.traces_base", d / "traces_base.py")
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base
    spec.loader.exec_module(base)
    rng = random.Random(0)
    path = d / "trace.csv"
    with path.open("w") as f:
        f.write("job_id,submit_time,duration_s,num_gpus,team\n")
        for i in range(a.rows):
            f.write(f"j{i},{i * 3},{rng.randint(60, 86400)},{rng.choice([1, 2, 4, 8])},team{i % 7}\n")
    runs: dict[str, list[float]] = {"base": [], "new": []}
    for _ in range(a.reps):
        for name, mod in (("base", base), ("new", new)):
            t0 = time.perf_counter()
            tr = mod.load_generic_csv(path)
            runs[name].append(time.perf_counter() - t0)
            assert len(tr.jobs) == a.rows and not tr.skipped, tr.skipped
    print({k: [round(x, 3) for x in v] for k, v in runs.items()},
          "ratio new/base (best runs):", round(min(runs["new"]) / min(runs["base"]), 3))


if __name__ == "__main__":
    main()
