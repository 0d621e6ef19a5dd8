#!/usr/bin/env python3
"""Build the small data bundle in ``pricing/data/`` from the shared data folder.

Usage::

    python3 scripts/bundle_data.py [SHARED_DATA_DIR]   # default: ../shared/data

The product reads only ``pricing/data/``; this script is how that folder was
made, so it must stay reproducible: same input -> byte-identical output (gzip
with ``mtime=0`` and no file name, fixed row order, fixed rounding).

Outputs (all under ``pricing/data/``):

* ``carbon_intensity_lca_2023-2024_utc.csv.gz`` — wide: ``datetime_utc`` + one
  column per zone, Electricity Maps LCA carbon intensity in gCO2e/kWh, rounded
  to 0.1, hourly UTC 2023-01-01 00:00 .. 2024-12-31 23:00.
  Zones of ``MORE_CARBON_ZONES`` (the shared folder's ``carbon_intensity/more``)
  are added; hours their source lacks are copied from 52 weeks earlier.
* ``carbon_zones.csv`` — per zone: the ``Zone Id`` in the source file, the
  share of 2023-2024 hours flagged ``Data Estimated``, the source folder, the
  number of hours copied from an earlier year and ``carbon_estimated``.
* ``carbon_annual_zones.csv`` — zones with no hourly series: one published
  annual gCO2e/kWh figure each (``ANNUAL_CARBON_ZONES``).
* ``electricity_prices_2023-2024_utc.csv.gz`` — wide: ``datetime_utc`` + one
  column per zone, price in the zone's ORIGINAL currency per MWh (rounded to
  1e-5), converted to UTC interval-start instants; missing hours are empty.
* ``electricity_price_zones.csv`` — per zone: currency, unit, market/node,
  source time semantics, counts of hours present / missing / conflicting
  duplicates averaged.
* ``aws_gpu_vms_skypilot_catalog_v9_subset.csv`` — verbatim copy.
* ``gcp_gpu_vms_skypilot_schema_anycloud_2026-05-20.csv.gz`` — filtered: GPU
  accelerator rows (no TPU) + a2/a3/a4/g2 VM rows + every n1-standard/n1-highmem
  host row (hosts of attachable GPUs, see ``pricing.catalog.gcp_n1_hosts``), only in
  zones that offer an attachable GPU.
* ``spot_availability_1node.csv.gz`` — one row per 1-node availability trace:
  ``zone,accelerator,count,campaign,gap_seconds,values`` (values = "0101...").
* ``mlco2_impact_gpus.csv`` — verbatim copy.

Electricity price time handling (from /work/shared/data/SOURCES.md §3, with
one evidence-based exception for GB, see ``PRICE_ZONES``): naive timestamps are
interpreted in the stated zone; a non-existent spring-forward local hour maps
to the same UTC instant as the next hour (the origin filled it with a copy of
that hour, so the two rows are equal); a dropped fall-back hour stays missing.
Rows that land on the same UTC hour are averaged (this is how the AEMO
month-boundary duplicates with different partial averages are resolved).
"""

from __future__ import annotations

import gzip
import io
import shutil
import sys
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "pricing" / "data"

START = pd.Timestamp("2023-01-01 00:00", tz="UTC")
END = pd.Timestamp("2024-12-31 23:00", tz="UTC")
HOURS = pd.date_range(START, END, freq="h")

CARBON_ZONES = [
    "US-CAL-CISO", "US-MIDA-PJM", "US-NY-NYIS", "US-TEX-ERCO", "DE-LU", "GB",
    "CA-ON", "BR-SP", "CL-SIC", "JP-TK", "KR", "SG", "IN-WE", "AU-NSW", "AU-VIC", "ZA",
]
LCA_COL = "Carbon Intensity gCO₂eq/kWh (LCA)"

# zone -> (time semantics, IANA tz or None, currency, market/node)
# semantics: "utc" naive UTC; "offset" has explicit UTC offset; "local" naive
# wall-clock in the IANA zone (DST aware); "fixed" naive fixed-offset zone.
PRICE_ZONES: dict[str, tuple[str, str | None, str, str]] = {
    "US-CAL-CISO": ("utc", None, "USD", "CAISO OASIS day-ahead LMP, TH_NP15_GEN-APND"),
    "US-MIDA-PJM": ("utc", None, "USD", "PJM real-time hourly LMP, zone DOM"),
    "US-NY-NYIS": ("utc", None, "USD", "NYISO day-ahead hourly LMP, zone CAPITL"),
    "US-TEX-ERCO": ("offset", None, "USD", "ERCOT DAM SPP, HB_HUBAVG"),
    "DE-LU": ("local", "Europe/Paris", "EUR", "day-ahead, RTE eco2mix market data, perimeter DE+DL"),
    # GB: SOURCES.md assumes French local time for every EU file, but in each
    # spring-forward day of the GB file (2022-03-27, 2023-03-26, 2024-03-31)
    # the hour that was filled with a copy of the next one is 01:00 — the hour
    # that does not exist in UK time — while DE-LU/FR/NL fill 02:00 (the Paris
    # gap). We therefore read GB as Europe/London wall-clock time.
    "GB": ("local", "Europe/London", "EUR", "day-ahead, RTE eco2mix market data, perimeter GB"),
    "CA-ON": ("fixed", "Etc/GMT+5", "CAD", "IESO HOEP, hour-beginning EST (UTC-5, no DST)"),
    "JP-TK": ("local", "Asia/Tokyo", "JPY", "JEPX spot, Tokyo area, :00 half-hour slot"),
    "KR": ("local", "Asia/Seoul", "KRW", "KPX SMP hourly"),
    "SG": ("local", "Asia/Singapore", "SGD", "EMC USEP, first half-hour of each hour"),
    "AU-NSW": ("fixed", "Etc/GMT-10", "AUD", "AEMO PRICE_AND_DEMAND RRP hourly mean, NSW1 (file says USD: origin mislabel)"),
    "AU-VIC": ("fixed", "Etc/GMT-10", "AUD", "AEMO PRICE_AND_DEMAND RRP hourly mean, VIC1 (file says USD: origin mislabel)"),
}

GCP_VM_PREFIXES = ("a2-", "a3-", "a4-", "g2-")
# n1 host families that take attachable GPUs (pricing.catalog.GCP_N1_HOST_FAMILIES): every size is kept,
# the host rule (vCPU/memory limits per GPU count) lives in pricing.catalog
GCP_N1_HOST_RE = r"n1-(standard|highmem)-\d+"
GCP_N1_GPUS = ("V100", "T4", "P100", "P4", "K80")

MORE = Path("carbon_intensity") / "more"
EM_LCA_COLS = ("Carbon Intensity gCO₂eq/kWh (LCA)", "Carbon intensity gCO₂eq/kWh (Life cycle)", "carbon_intensity")
EM_TIME_COLS = ("Datetime (UTC)", "timestamp")
EM_EST_COLS = ("Data Estimated", "Data estimated")
#: zones beyond CARBON_ZONES: zone -> (file under the shared folder, column in a wide file or None for an EM file).
#: Hours of 2023-2024 the source does not cover are copied from the same hour 364 days (52 weeks: same weekday)
#: earlier, repeatedly, until a source hour is reached; such zones are flagged ``carbon_estimated``.
MORE_CARBON_ZONES: dict[str, tuple[Path, str | None]] = {
    **{z: (MORE / "electricitymaps_hourly_eu_2021-2024" / f"{z}_2021-2024_hourly.csv.gz", None)
       for z in ("BE", "FI", "FR", "IE", "SE")},
    **{z: (MORE / "electricitymaps_hourly_us_2023" / f"{z}_2023_hourly.csv.gz", None)
       for z in ("US-MIDW-MISO", "US-NW-BPAT", "US-NW-NEVP")},
    "CA-QC": (MORE / "electricitymaps_hourly_misc" / "CA-QC_2023_hourly.csv.gz", None),
    "NL": (MORE / "electricitymaps_hourly_misc" / "NL_2022_hourly.csv.gz", None),
    "US-CAR-SC": (MORE / "electricitymaps_2022_research_export" / "lca_2022_hourly_wide_via_decarbonization-potential.csv.gz",
                  "US-CAR-SC"),
}
FILL_SHIFT_H = 364 * 24

#: zones with no hourly series: one published annual figure per region (gCO2e/kWh), flagged as an estimate.
#: zone -> (source file under power_and_region_carbon/, provider, region of the row used, note)
ANNUAL_CARBON_ZONES: dict[str, tuple[str, str, str, str]] = {
    "TW": ("codecarbon_cloud_impact_gcp.csv", "gcp", "asia-east1", "Taiwan (Changhua County)"),
    "HK": ("codecarbon_cloud_impact_gcp.csv", "gcp", "asia-east2", "Hong Kong"),
    "IN-NO": ("codecarbon_cloud_impact_gcp.csv", "gcp", "asia-south2", "Delhi, northern Indian grid"),
    "ID": ("codecarbon_cloud_impact_gcp.csv", "gcp", "asia-southeast2", "Jakarta, Java-Bali grid"),
    "PL": ("codecarbon_cloud_impact_gcp.csv", "gcp", "europe-central2", "Warsaw"),
    "CH": ("codecarbon_cloud_impact_gcp.csv", "gcp", "europe-west6", "Zurich"),
    "SA": ("codecarbon_cloud_impact_gcp.csv", "gcp", "me-central2", "Dammam"),
    "IL": ("codecarbon_cloud_impact_gcp.csv", "gcp", "me-west1", "Tel Aviv"),
    "US-NW-PACE": ("codecarbon_cloud_impact_gcp.csv", "gcp", "us-west3", "Salt Lake City, PacifiCorp East"),
    "JP-KN": ("codecarbon_cloud_impact_gcp.csv", "gcp", "asia-northeast2", "Osaka, Kansai area (GCP Osaka figure)"),
    "ES": ("codecarbon_cloud_impact_gcp.csv", "gcp", "europe-southwest1",
           "Spain, peninsular grid (GCP Madrid figure)"),
    # no UAE figure in the shared data: the neighbouring, likewise gas-fired Qatari grid (GCP Doha) stands in
    "AE": ("codecarbon_cloud_impact_gcp.csv", "gcp", "me-cenrtal1",
           "PROXY: no UAE figure in the shared data; GCP Doha (Qatar) figure, region key spelled so in the origin"),
}


def _write_gz_csv(df: pd.DataFrame, path: Path) -> None:
    """Deterministic gzip CSV (mtime 0, no embedded file name, LF line ends)."""
    text = df.to_csv(index=False, lineterminator="\n")
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))


def _fmt(x: float, decimals: int) -> str:
    if np.isnan(x):
        return ""
    s = f"{x:.{decimals}f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def bundle_carbon(src: Path) -> None:
    cols: dict[str, list[str]] = {"datetime_utc": HOURS.strftime("%Y-%m-%dT%H:%M:%SZ").tolist()}
    meta = []
    for z in CARBON_ZONES:
        df = pd.read_csv(src / "carbon_intensity" / "electricitymaps_hourly" / f"{z}_2021-2024_hourly.csv.gz")
        t = pd.to_datetime(df["Datetime (UTC)"], utc=True)
        s = pd.Series(df[LCA_COL].to_numpy(float), index=t)
        s = s[~s.index.duplicated()].reindex(HOURS)
        est = df["Data Estimated"].astype(str).str.lower().eq("true").to_numpy()
        in_range = ((t >= START) & (t <= END)).to_numpy()
        meta.append({
            "zone": z,
            "zone_id_in_file": df["Zone Id"].iloc[0],
            "hours": int(s.notna().sum()),
            "missing_hours": int(s.isna().sum()),
            "estimated_share": round(float(est[in_range].mean()), 4),
        })
        meta[-1].update(source="electricitymaps_hourly", filled_hours=0, carbon_estimated=False)
        cols[z] = [_fmt(v, 1) for v in s.to_numpy()]
    for z, (rel, wide_col) in MORE_CARBON_ZONES.items():
        values, m = _more_zone(src / rel, wide_col)
        meta.append({"zone": z, **m, "source": str(rel.parent.relative_to(MORE))})
        cols[z] = [_fmt(v, 1) for v in values]
    _write_gz_csv(pd.DataFrame(cols), OUT / "carbon_intensity_lca_2023-2024_utc.csv.gz")
    pd.DataFrame(meta).to_csv(OUT / "carbon_zones.csv", index=False, lineterminator="\n")
    bundle_annual_carbon(src)


def _pick(df: pd.DataFrame, names: tuple[str, ...]) -> str | None:
    return next((c for c in names if c in df.columns), None)


def _more_zone(path: Path, wide_col: str | None) -> tuple[np.ndarray, dict]:
    """2023-2024 hourly LCA values of one supplementary zone, gaps filled from 52 weeks earlier (see
    MORE_CARBON_ZONES), and its carbon_zones.csv row (without zone/source)."""
    df = pd.read_csv(path)
    if wide_col is None:
        t = pd.to_datetime(df[_pick(df, EM_TIME_COLS)], utc=True)
        v = df[_pick(df, EM_LCA_COLS)].to_numpy(float)
        est_col = _pick(df, EM_EST_COLS)
        est = df[est_col].astype(str).str.lower().eq("true").to_numpy() if est_col else np.zeros(len(df), bool)
        zone_id = str(df["Zone Id" if "Zone Id" in df.columns else "Zone id"].iloc[0])
    else:
        t = pd.to_datetime(df["datetime_utc"], utc=True)
        v = df[wide_col].to_numpy(float)
        est = np.zeros(len(df), bool)
        zone_id = wide_col
    src = pd.Series(v, index=t)
    src = src[~src.index.duplicated()].dropna()
    src_est = pd.Series(est, index=t)
    src_est = src_est[~src_est.index.duplicated()]
    out = np.full(HOURS.size, np.nan)
    used_est = []
    filled = 0
    lookup = src.to_dict()
    first = src.index.min()
    for i, h in enumerate(HOURS):
        k = 0
        while h - pd.Timedelta(hours=FILL_SHIFT_H * k) not in lookup:
            k += 1
            if h - pd.Timedelta(hours=FILL_SHIFT_H * k) < first - pd.Timedelta(days=1):
                raise SystemExit(f"{path.name}: no source hour for {h}")
        hh = h - pd.Timedelta(hours=FILL_SHIFT_H * k)
        out[i] = lookup[hh]
        used_est.append(bool(src_est.get(hh, False)))
        filled += k > 0
    return out, {"zone_id_in_file": zone_id, "hours": int(HOURS.size - filled), "missing_hours": 0,
                 "estimated_share": round(float(np.mean(used_est)), 4), "filled_hours": int(filled),
                 "carbon_estimated": bool(filled > 0)}


def bundle_annual_carbon(src: Path) -> None:
    """``carbon_annual_zones.csv``: zone, gCO2e/kWh, the provider/region row it comes from, source file, note."""
    rows = []
    for z, (fname, provider, region, note) in ANNUAL_CARBON_ZONES.items():
        t = pd.read_csv(src / "power_and_region_carbon" / fname, encoding="utf-8-sig")
        r = t[(t["provider"] == provider) & (t["region"] == region)]
        if len(r) != 1:
            raise SystemExit(f"{fname}: expected one row for {provider} {region}, got {len(r)}")
        rows.append({"zone": z, "gco2e_per_kwh": float(r["impact"].iloc[0]), "source_file": fname,
                     "source_provider": provider, "source_region": region, "source_url": r["source"].iloc[0],
                     "note": note})
    pd.DataFrame(rows).to_csv(OUT / "carbon_annual_zones.csv", index=False, lineterminator="\n")


def _epoch_s(t: pd.Series) -> np.ndarray:
    """POSIX seconds of a tz-aware datetime Series (independent of pandas' time resolution)."""
    return ((t - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(float)


def _to_utc_seconds(dt: pd.Series, semantics: str, tz: str | None) -> np.ndarray:
    if semantics == "utc":
        return _epoch_s(pd.to_datetime(dt).dt.tz_localize("UTC"))
    if semantics == "offset":
        return _epoch_s(pd.to_datetime(dt, utc=True))
    # local / fixed: same rule as HourlySeries.from_local (fold=0; a repeated
    # wall-clock time given again in order gets fold=1).
    z = ZoneInfo(tz)
    out = np.empty(len(dt))
    prev = None
    for i, s in enumerate(dt.astype(str)):
        lt = datetime.fromisoformat(s)
        v = lt.replace(tzinfo=z, fold=0).timestamp()
        if prev is not None and v <= prev:
            v2 = lt.replace(tzinfo=z, fold=1).timestamp()
            if v2 > prev:
                v = v2
        out[i] = v
        prev = v
    return out


def bundle_prices(src: Path) -> None:
    grid = _epoch_s(pd.Series(HOURS))
    cols: dict[str, list[str]] = {"datetime_utc": HOURS.strftime("%Y-%m-%dT%H:%M:%SZ").tolist()}
    meta = []
    for z, (sem, tz, cur, market) in PRICE_ZONES.items():
        df = pd.read_csv(src / "electricity_prices" / f"{z}_prices_hourly.csv.gz")
        price_col = df.columns[1]
        # keep a margin of two days either side before conversion, then clip
        y = df["Datetime"].astype(str).str[:10]
        df = df[(y >= "2022-12-30") & (y <= "2025-01-02")].reset_index(drop=True)
        t = _to_utc_seconds(df["Datetime"], sem, tz)
        v = df[price_col].to_numpy(float)
        keep = (t >= grid[0]) & (t <= grid[-1])
        t, v = t[keep], v[keep]
        if np.any(np.abs(t / 3600 - np.rint(t / 3600)) > 1e-9):
            raise SystemExit(f"{z}: timestamps off the hourly grid")
        idx = ((t - grid[0]) // 3600).astype(int)
        ser = pd.Series(v).groupby(idx)
        mean = ser.mean()
        nuniq = ser.nunique()
        counts = ser.size()
        values = np.full(grid.size, np.nan)
        values[mean.index.to_numpy()] = mean.to_numpy()
        meta.append({
            "zone": z,
            "currency": cur,
            "unit": f"{cur}/MWh",
            "source_column": price_col,
            "source_time": {"utc": "naive UTC", "offset": "local with UTC offset", "local": f"naive local {tz}",
                            "fixed": f"naive fixed offset {tz}"}[sem],
            "market": market,
            "hours": int(np.isfinite(values).sum()),
            "missing_hours": int(np.isnan(values).sum()),
            "duplicate_hours": int((counts > 1).sum()),
            "conflicting_duplicates_averaged": int((nuniq > 1).sum()),
        })
        cols[z] = [_fmt(x, 5) for x in values]
    _write_gz_csv(pd.DataFrame(cols), OUT / "electricity_prices_2023-2024_utc.csv.gz")
    pd.DataFrame(meta).to_csv(OUT / "electricity_price_zones.csv", index=False, lineterminator="\n")


def bundle_cloud(src: Path) -> None:
    shutil.copyfile(src / "cloud_prices" / "aws_gpu_vms_skypilot_catalog_v9_subset.csv",
                    OUT / "aws_gpu_vms_skypilot_catalog_v9_subset.csv")
    g = pd.read_csv(src / "cloud_prices" / "gcp_vms_skypilot_schema_anycloud_2026-05-20.csv.gz", dtype=str, keep_default_na=False)
    acc = g[(g["InstanceType"] == "") & (g["AcceleratorName"] != "") & ~g["AcceleratorName"].str.lower().str.startswith("tpu")]
    it = g["InstanceType"]
    vm = g[it.str.startswith(GCP_VM_PREFIXES)]
    n1_zones = set(acc.loc[acc["AcceleratorName"].isin(GCP_N1_GPUS), "AvailabilityZone"])
    n1 = g[it.str.fullmatch(GCP_N1_HOST_RE) & g["AvailabilityZone"].isin(n1_zones)]
    out = pd.concat([vm, n1, acc]).sort_index()
    text = out.to_csv(index=False, lineterminator="\n")
    with open(OUT / "gcp_gpu_vms_skypilot_schema_anycloud_2026-05-20.csv.gz", "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))


def bundle_spot(src: Path) -> None:
    s = pd.read_csv(src / "spot_traces" / "skypilot_spot_traces_long.csv.gz")
    s = s[(s["trace_kind"] == "availability") & (s["nodes"] == "1-node")]
    rows = []
    for path, grp in s.groupby("source_path", sort=True):
        grp = grp.sort_values("tick")
        ticks = grp["tick"].to_numpy()
        if not np.array_equal(ticks, np.arange(ticks.size)):
            raise SystemExit(f"{path}: ticks not contiguous")
        vals = grp["value"].to_numpy()
        if not set(np.unique(vals)) <= {0, 1}:
            raise SystemExit(f"{path}: values not 0/1")
        first = grp.iloc[0]
        rows.append({
            "zone": first["zone"],
            "accelerator": first["accelerator_or_cpu"],
            "count": int(first["count_in_name"]),
            "campaign": first["campaign"],
            "gap_seconds": int(first["gap_seconds"]),
            "source_path": path,
            "values": "".join(map(str, vals.astype(int))),
        })
    _write_gz_csv(pd.DataFrame(rows), OUT / "spot_availability_1node.csv.gz")


def main(argv: list[str]) -> None:
    src = Path(argv[1]) if len(argv) > 1 else (REPO / ".." / "shared" / "data")
    src = src.resolve()
    if not (src / "SOURCES.md").exists():
        raise SystemExit(f"shared data folder not found: {src}")
    OUT.mkdir(parents=True, exist_ok=True)
    bundle_carbon(src)
    bundle_prices(src)
    bundle_cloud(src)
    bundle_spot(src)
    shutil.copyfile(src / "power_and_region_carbon" / "mlco2_impact_gpus.csv", OUT / "mlco2_impact_gpus.csv")
    total = sum(p.stat().st_size for p in OUT.iterdir() if p.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main(sys.argv)
