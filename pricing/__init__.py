"""fedbroker pricing: grid signals, cloud offers and the GPU power model.

Modules (one idea each):

* :mod:`pricing.series` — :class:`HourlySeries`, UTC hourly series with O(1) window integrals.
* :mod:`pricing.carbon` — bundled hourly carbon intensity per grid zone, gCO2e/kWh.
* :mod:`pricing.electricity` — bundled hourly electricity prices per grid zone, USD/MWh.
* :mod:`pricing.fx` — dated FX table, ``to_usd``.
* :mod:`pricing.regions` — (provider, region) -> grid zone table.
* :mod:`pricing.power` — GPU specs, power model, cloud PUE.
* :mod:`pricing.spot` — spot availability traces and interruption rates.
* :mod:`pricing.offers` — :class:`CloudOffer` (a priced cloud option) and :class:`Market`.
* :mod:`pricing.billing` — per-provider billing rules (minimum, increment, source) and billed seconds.
* :mod:`pricing.catalog` — priced AWS/GCP GPU offers from the bundled catalogs.
* :mod:`pricing.signals` — :class:`GridSignals` for the planner.
* :mod:`pricing.hygiene` — completeness, sub-hourly to hourly, gap interpolation, fallbacks (:class:`CheckedSeries`).
* :mod:`pricing.sources` — signal source interfaces (latest/history/forecast), fetch errors, bundled sources.
* :mod:`pricing.carbon_sources` — GB Carbon Intensity API, Electricity Maps.
* :mod:`pricing.price_sources` — operator tariff (fixed/time-of-use), ENTSO-E day-ahead via ``entsoe-py``.
* :mod:`pricing.user_signals` — user hourly carbon/price CSVs (``simulate --signals DIR``).
* :mod:`pricing.forecast` — carbon and price forecasts from the hours before the issue time (``forecast()``).
* :mod:`pricing.forecast_eval` — their error (MAE, MAPE by horizon bucket) and the fit of the blend parameters.
* :mod:`pricing.errors` — the exception tree of bad input (all ``ValueError``; fetch faults are
  :class:`pricing.sources.SourceError`, a ``RuntimeError``).

Imports nothing from ``broker`` (an import-linter contract in ``pyproject.toml``). Data lives in
``pricing/data`` (built by ``scripts/bundle_data.py``; sources and licences in ``pricing/data/SOURCES.md``).
"""
