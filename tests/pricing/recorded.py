"""Recorded-response builders for the signal feeds, shaped as each API documents its answers.

Served with ``responses`` (which intercepts ``requests``; an unregistered URL raises ``ConnectionError``, so no
test reaches the network).

* GB Carbon Intensity API (https://carbon-intensity.github.io/api-definitions/): national
  ``{"data": [{"from": "2018-01-20T12:00Z", "to": "2018-01-20T12:30Z",
  "intensity": {"forecast": 266, "actual": 263, "index": "moderate"}}]}``; regional range endpoints answer
  ``{"data": {"regionid": 13, "dnoregion": "UKPN London", "shortname": "London", "data": [{"from", "to",
  "intensity": {"forecast", "index"}, "generationmix": [{"fuel", "perc"}]}]}}`` and ``/regional/regionid/{id}``
  a list of one such object.
* Electricity Maps v3: ``/carbon-intensity/latest`` ``{"zone", "carbonIntensity", "datetime", "updatedAt",
  "createdAt", "emissionFactorType", "isEstimated", "estimationMethod"}``; ``past-range`` ``{"zone", "data": [..]}``;
  ``forecast`` ``{"zone", "forecast": [{"carbonIntensity", "datetime"}], "updatedAt"}``.
* WattTime API v3 (https://docs.watttime.org): ``/login`` ``{"token": "..."}``; ``/v3/historical`` and
  ``/v3/forecast`` ``{"data": [{"point_time": "2024-03-31T00:00:00+00:00", "value": 955.0}, ...], "meta":
  {"data_point_period_seconds": 300, "region": "CAISO_NORTH", "signal_type": "co2_moer", "units":
  "lbs_co2_per_mwh", "warnings": [], "model": {"date": "2023-03-01"}}}`` (the forecast's meta adds
  ``generated_at``).
* ENTSO-E Transparency Platform, A44 day-ahead prices: a ``Publication_MarketDocument`` (IEC 62325-351) with one
  ``TimeSeries`` of ``Period``\\s (``timeInterval``, ``resolution`` PT60M/PT15M, ``Point``\\s of ``position`` and
  ``price.amount``); no data is an ``Acknowledgement_MarketDocument`` whose ``Reason`` text says "No matching data
  found" (served with status 200).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone


def iso_min(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%MZ")


def gb_period(t: datetime, forecast, actual=None, *, regional: bool = False) -> dict:
    """One half-hour row starting at ``t`` (UTC)."""
    inten = {"forecast": forecast, "index": "moderate"}
    if not regional:
        inten["actual"] = actual
    row = {"from": iso_min(t), "to": iso_min(t + timedelta(minutes=30)), "intensity": inten}
    if regional:
        row["generationmix"] = [{"fuel": "gas", "perc": 40.1}, {"fuel": "wind", "perc": 59.9}]
    return row


def gb_national(rows: list[dict]) -> dict:
    return {"data": rows}


def gb_regional(regionid: int, rows: list[dict], *, as_list: bool = False) -> dict:
    obj = {"regionid": regionid, "dnoregion": "UKPN London", "shortname": "London", "data": rows}
    return {"data": [obj] if as_list else obj}


def em_point(zone: str, t: datetime, ci, *, estimated: bool = False) -> dict:
    return {"zone": zone, "carbonIntensity": ci, "datetime": t.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            "updatedAt": "2024-03-31T12:05:11.123Z", "createdAt": "2024-03-28T12:05:11.123Z",
            "emissionFactorType": "lifecycle", "isEstimated": estimated,
            "estimationMethod": "TIME_SLICER_AVERAGE" if estimated else None}


def em_forecast(zone: str, points: list[tuple[datetime, float]]) -> dict:
    return {"zone": zone, "forecast": [{"carbonIntensity": v, "datetime": t.strftime("%Y-%m-%dT%H:%M:%S.000Z")}
                                       for t, v in points], "updatedAt": "2024-03-31T12:05:11.123Z"}


def wt_body(region: str, points: list[tuple[datetime, float | None]], *, forecast: bool = False,
            units: str = "lbs_co2_per_mwh") -> dict:
    """A WattTime v3 data answer: 5-minute ``points`` of (UTC start, lbs CO2/MWh or None)."""
    meta = {"data_point_period_seconds": 300, "region": region, "signal_type": "co2_moer", "units": units,
            "warnings": [], "model": {"date": "2023-03-01"}}
    if forecast:
        meta["generated_at_period_seconds"] = 300
        meta["generated_at"] = "2024-03-31T00:00:00+00:00"
    return {"data": [{"point_time": t.strftime("%Y-%m-%dT%H:%M:%S+00:00"), "value": v} for t, v in points],
            "meta": meta}


ENTSOE_NS = "urn:iec62325.351:tc57wg16:451-3:publicationdocument:7:3"


def entsoe_prices_xml(area_code: str, start: datetime, resolution_min: int, prices: list[float]) -> str:
    """A44 document: one period from ``start`` (UTC) with ``prices`` at ``resolution_min`` minutes."""
    end = start + timedelta(minutes=resolution_min * len(prices))
    fmt = "%Y-%m-%dT%H:%MZ"
    points = "\n".join(f"        <Point>\n          <position>{i + 1}</position>\n"
                       f"          <price.amount>{p:.2f}</price.amount>\n        </Point>" for i, p in enumerate(prices))
    return f"""<?xml version="1.0" encoding="utf-8"?>
<Publication_MarketDocument xmlns="{ENTSOE_NS}">
  <mRID>b9e9a7a5f7c94e7f9d7b3d2a8c1e4f60</mRID>
  <revisionNumber>1</revisionNumber>
  <type>A44</type>
  <sender_MarketParticipant.mRID codingScheme="A01">10X1001A1001A450</sender_MarketParticipant.mRID>
  <sender_MarketParticipant.marketRole.type>A32</sender_MarketParticipant.marketRole.type>
  <receiver_MarketParticipant.mRID codingScheme="A01">10X1001A1001A450</receiver_MarketParticipant.mRID>
  <receiver_MarketParticipant.marketRole.type>A33</receiver_MarketParticipant.marketRole.type>
  <createdDateTime>2024-10-26T10:45:12Z</createdDateTime>
  <period.timeInterval>
    <start>{start.strftime(fmt)}</start>
    <end>{end.strftime(fmt)}</end>
  </period.timeInterval>
  <TimeSeries>
    <mRID>1</mRID>
    <auction.type>A01</auction.type>
    <businessType>A62</businessType>
    <in_Domain.mRID codingScheme="A01">{area_code}</in_Domain.mRID>
    <out_Domain.mRID codingScheme="A01">{area_code}</out_Domain.mRID>
    <contract_MarketAgreement.type>A01</contract_MarketAgreement.type>
    <currency_Unit.name>EUR</currency_Unit.name>
    <price_Measure_Unit.name>MWH</price_Measure_Unit.name>
    <curveType>A03</curveType>
    <Period>
      <timeInterval>
        <start>{start.strftime(fmt)}</start>
        <end>{end.strftime(fmt)}</end>
      </timeInterval>
      <resolution>PT{resolution_min}M</resolution>
{points}
    </Period>
  </TimeSeries>
</Publication_MarketDocument>
"""


ENTSOE_NO_DATA = """<?xml version="1.0" encoding="utf-8"?>
<Acknowledgement_MarketDocument xmlns="urn:iec62325.351:tc57wg16:451-1:acknowledgementdocument:7:0">
  <mRID>3a1c5e3b-0b8f-4b52-9d0d-1f5c6a2e7b11</mRID>
  <createdDateTime>2024-10-26T10:45:12Z</createdDateTime>
  <sender_MarketParticipant.mRID codingScheme="A01">10X1001A1001A450</sender_MarketParticipant.mRID>
  <sender_MarketParticipant.marketRole.type>A32</sender_MarketParticipant.marketRole.type>
  <receiver_MarketParticipant.mRID codingScheme="A01">10X1001A1001A450</receiver_MarketParticipant.mRID>
  <receiver_MarketParticipant.marketRole.type>A39</receiver_MarketParticipant.marketRole.type>
  <received_MarketDocument.createdDateTime>2024-10-26T10:45:12Z</received_MarketDocument.createdDateTime>
  <Reason>
    <code>999</code>
    <text>No matching data found for Data item Energy Prices [12.1.D] (10Y1001A1001A82H, 10Y1001A1001A82H) and interval 2030-01-01T00:00:00.000Z/2030-01-02T00:00:00.000Z.</text>
  </Reason>
</Acknowledgement_MarketDocument>
"""


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)
