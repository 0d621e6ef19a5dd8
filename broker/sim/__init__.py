"""The simulator: the same planner on a virtual clock over real traces and signals.

* :mod:`.traces` — job traces (Philly, Slurm ``sacct``) as :class:`~broker.sim.traces.Trace`;
* :mod:`.scenario` — the bundled inputs: pools, offers, grid signals, spot traces;
* :mod:`.simulator` — the discrete-event simulator;
* :mod:`.results` and :mod:`.report` — the metrics of a run, ``results.json`` and the HTML report.
"""
