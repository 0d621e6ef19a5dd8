"""Live cloud GPU prices: AWS EC2 spot price history, the AWS Price List API, the GCP Cloud Billing Catalog.

Every price here is **USD per instance-hour** (``USD/h``, :data:`CLOUD_PRICE_UNIT`), the unit of
:attr:`pricing.offers.CloudOffer.usd_per_hour`.

**AWS spot** (:class:`AwsSpotPrices`): ``ec2.describe_spot_price_history`` per region (paginated with
``NextToken``), for the instance types asked and product ``Linux/UNIX``. AWS returns each price *change*
(``Timestamp``, ``SpotPrice``) per availability zone and instance type, plus the last change before
``StartTime`` (the price in force when the window opens). Zones are keyed by ``AvailabilityZoneId``
(``use1-az2``, as in the bundled catalog) when AWS sends it, else by ``AvailabilityZone`` (``us-east-1a``).
The records form a **step function** (a price holds from its timestamp until the next change), turned
into UTC hours by :func:`step_to_hourly`:

    the value of an hour is the time-weighted mean of the price in force over the part of the hour that
    lies after the first record and before the fetch time (``until_s``); a price that changes at
    ``hh:20`` from 1.00 to 2.00 gives that hour ``(20 x 1.00 + 40 x 2.00) / 60 = 1.6667`` USD/h. An hour
    with no such part is missing (``NaN``); an hour only partly covered (the current hour, or the hour of
    the first record) is the mean over its covered part and is flagged estimated.

**AWS on-demand** (:class:`AwsPriceList`): ``pricing.get_products`` (the Price List Query API; its endpoint
is in ``us-east-1``) of service ``AmazonEC2``, one paginated query per instance type with the filters of a
plain on-demand Linux VM (:data:`AWS_ON_DEMAND_FILTERS`: ``operatingSystem=Linux``, ``tenancy=Shared``,
``preInstalledSw=NA``, ``capacitystatus=Used``, ``licenseModel=No License required``). Each ``PriceList``
entry is a JSON document; the price is ``terms.OnDemand.<offer>.priceDimensions.<rate>.pricePerUnit.USD``
of the dimension with ``unit == "Hrs"``, and its region ``product.attributes.regionCode``.

**GCP** (:class:`GcpBillingCatalog`): the Cloud Billing Catalog API
``GET https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus`` (Compute Engine), followed by
``nextPageToken``. A SKU is kept when its description names a GPU (``Nvidia Tesla T4 GPU running in
Americas``), a machine family's vCPU (``A2 Instance Core running in ...``, ``N1 Predefined Instance Core
...``) or its memory (``... Instance Ram ...``), and ``category.usageType`` is ``OnDemand`` (on-demand) or
``Preemptible`` (spot; commitments are skipped). Its price is the last tier of the newest ``pricingInfo``,
``unitPrice.units + unitPrice.nanos / 1e9`` in ``currencyCode`` (converted to USD with :mod:`pricing.fx`),
per ``usageUnit`` (``h`` per GPU or vCPU, ``GiBy.h`` per GiB of memory), in each of ``serviceRegions``.
An instance costs ``vCPUs x core + GiB x RAM + GPUs x GPU`` of its family and region
(:meth:`GcpRates.instance_price`), the host shape read from the bundled GCP catalog.

**Errors** (:mod:`pricing.sources`): throttling (``Throttling``, ``ThrottlingException``,
``RequestLimitExceeded``, HTTP 429) -> :class:`~pricing.sources.RateLimited` with the ``Retry-After`` hint
when the answer has one; refused credentials (``AuthFailure``, ``UnauthorizedOperation``,
``AccessDenied*``, ``InvalidClientTokenId``, ``ExpiredToken``, HTTP 401/403, no credentials found) ->
:class:`~pricing.sources.SourceAuthError`; 5xx, a connection error or an unreadable answer ->
:class:`~pricing.sources.SourceUnavailable`. Messages carry the error code and status only. The clients
are built with one attempt per call (``botocore`` retries off): retries and back-off are the caller's
(the signal cache's) rule. Credentials come from the normal chains (boto3's, ``google.auth.default``) and
are never logged.

**Re-pricing** (:func:`reprice_offers`): each bundled :class:`~pricing.offers.CloudOffer` takes its live
price for an hour from a :class:`CloudPriceBook` when the book has a positive one, else keeps its bundled
catalog price; :class:`PriceOrigin` says which (``price_source``) and how old.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from pricing.hygiene import HOUR_S, CheckedSeries, hour_grid
from pricing.offers import CloudOffer, Market
from pricing.series import HourlySeries
from pricing.sources import (HttpJson, RateLimited, SourceAuthError, SourceError, SourceUnavailable,
                             retry_after_seconds)

__all__ = ["CLOUD_PRICE_UNIT", "AWS_SPOT", "AWS_PRICE_LIST", "GCP_BILLING_CATALOG", "BUNDLED_CATALOG",
           "AWS_ON_DEMAND_FILTERS", "GCP_COMPUTE_SERVICE", "step_to_hourly", "aws_error", "AwsSpotPrices",
           "AwsPriceList", "GcpSku", "GcpRates", "GcpBillingCatalog", "LivePrice", "PriceOrigin",
           "CloudPriceBook", "OfferPrices", "live_source_for", "reprice_offers"]

#: unit of every price here: USD per instance-hour
CLOUD_PRICE_UNIT = "USD/h"
#: source names (the ``price_source`` of a re-priced offer)
AWS_SPOT = "aws-spot-history"
AWS_PRICE_LIST = "aws-price-list"
GCP_BILLING_CATALOG = "gcp-billing-catalog"
BUNDLED_CATALOG = "bundled-catalog"

#: Price List filters of a plain on-demand Linux VM (attribute names and values as the AmazonEC2 offer file
#: spells them; ``capacitystatus=Used`` leaves out the capacity-reservation rows)
AWS_ON_DEMAND_FILTERS: tuple[tuple[str, str], ...] = (
    ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"),
    ("licenseModel", "No License required"),
)
#: the Cloud Billing Catalog id of the Compute Engine service
GCP_COMPUTE_SERVICE = "services/6F81-5844-456A"
GCP_BILLING_SCOPE = "https://www.googleapis.com/auth/cloud-billing.readonly"

_THROTTLE_CODES = frozenset({"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
                             "RequestThrottled", "RequestThrottledException", "SlowDown"})
_AUTH_CODES = frozenset({"AuthFailure", "UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
                         "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException", "UnrecognizedClientException",
                         "SignatureDoesNotMatch", "OptInRequired", "IncompleteSignature", "MissingAuthenticationToken"})


# --------------------------------------------------------------------------------------------- step -> hours
def step_to_hourly(times_s: Sequence[float] | np.ndarray, prices: Sequence[float] | np.ndarray, *, start_s: float,
                   end_s: float, until_s: float, zone: str, source: str) -> CheckedSeries:
    """Price changes (a step function) as the UTC hours of ``[start_s, end_s)``, USD/h (the rule: module docstring).

    Args:
        times_s: POSIX seconds of each price change (any order; a repeated instant keeps its last price).
        prices: the price from that instant on, USD/h (finite, > 0).
        start_s, end_s: the window; one value per UTC hour of it.
        until_s: the fetch time, POSIX s: no price is known after it.
        zone, source: label of the result.

    Returns a :class:`CheckedSeries` (``NaN`` for hours with no known part; partly covered hours estimated).
    Raises ``ValueError`` naming ``prices`` for a non-finite or non-positive price, or mismatched lengths.
    """
    t = np.asarray(times_s, dtype=np.float64).ravel()
    p = np.asarray(prices, dtype=np.float64).ravel()
    if t.shape != p.shape:
        raise ValueError(f"times_s/prices: lengths differ ({t.size}, {p.size})")
    if p.size and not (np.isfinite(p).all() and (p > 0).all()):
        bad = p[~(np.isfinite(p) & (p > 0))][0]
        raise ValueError(f"prices: {float(bad)!r} is not a price > 0 USD/h")
    order = np.argsort(t, kind="stable")
    t, p = t[order], p[order]
    if t.size:  # a repeated instant: the last record wins
        keep = np.append(t[1:] != t[:-1], True)
        t, p = t[keep], p[keep]
    grid = hour_grid(start_s, end_s)
    vals = np.full(grid.size, np.nan)
    est = np.zeros(grid.size, dtype=bool)
    for i, h in enumerate(grid):
        a = max(float(h), float(t[0])) if t.size else math.inf
        b = min(float(h) + HOUR_S, until_s)
        if not b > a:
            continue
        # pieces: [a, b) cut at every change inside it; the price of a piece is the last change at or before it
        cuts = np.concatenate(([a], t[(t > a) & (t < b)], [b]))
        idx = np.searchsorted(t, cuts[:-1], side="right") - 1
        vals[i] = float(np.sum(p[idx] * np.diff(cuts)) / (b - a))
        est[i] = (b - a) < HOUR_S - 1e-6
    return CheckedSeries.of(HourlySeries(zone, CLOUD_PRICE_UNIT, float(grid[0]), vals), source, est)


# --------------------------------------------------------------------------------------------- AWS errors
def aws_error(source: str, e: BaseException, what: str) -> SourceError:
    """The :class:`~pricing.sources.SourceError` of a boto3/botocore exception ``e`` raised by call ``what``.

    Throttling codes or HTTP 429 -> :class:`RateLimited` (``retry_after_s`` from a ``Retry-After`` header, else
    ``None``); credential codes, HTTP 401/403 or no credentials -> :class:`SourceAuthError`; anything else ->
    :class:`SourceUnavailable` (with the HTTP status when there is one). The message holds the code and
    status only (never AWS's message text or a credential).
    """
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {}) or {}
        meta = e.response.get("ResponseMetadata", {}) or {}
        code = str(err.get("Code", ""))
        status = meta.get("HTTPStatusCode")
        status = int(status) if status is not None else None
        if code in _THROTTLE_CODES or status == 429:
            hint = retry_after_seconds((meta.get("HTTPHeaders") or {}).get("retry-after"))
            return RateLimited(source, f"{what}: {code or 'throttled'} (HTTP {status})", status, hint)
        if code in _AUTH_CODES or status in (401, 403):
            return SourceAuthError(source, f"{what}: {code} (HTTP {status}; check the AWS credentials and the "
                                   "IAM permission)", status)
        return SourceUnavailable(source, f"{what}: {code} (HTTP {status})", status)
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
        return SourceAuthError(source, f"{what}: no usable AWS credentials in the boto3 chain ({type(e).__name__})")
    return SourceUnavailable(source, f"{what}: {type(e).__name__}")


def _aws_client(service: str, region: str, timeout_s: float) -> Any:
    """A boto3 client with one attempt per call (the caller retries) and ``timeout_s`` connect/read timeouts."""
    import boto3
    from botocore.config import Config

    cfg = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=timeout_s,
                 read_timeout=timeout_s)
    return boto3.client(service, region_name=region, config=cfg)


def _aws_pages(source: str, client: Any, op: str, params: dict[str, Any]) -> Iterable[dict]:
    """The pages of a paginated boto3 call, botocore errors mapped by :func:`aws_error`."""
    from botocore import exceptions as bx

    try:
        for page in client.get_paginator(op).paginate(**params):
            yield page
    except (bx.BotoCoreError, bx.ClientError) as e:
        raise aws_error(source, e, op) from None


# --------------------------------------------------------------------------------------------- AWS spot
class AwsSpotPrices:
    """AWS EC2 spot price history, hourly USD/h per (zone, instance type) (module docstring).

    Args:
        client_factory: ``region -> ec2 client`` (default: boto3 with the normal credential chain, one attempt
            per call; tests pass a client wrapped in botocore's ``Stubber``).
        product: the ``ProductDescriptions`` filter (``Linux/UNIX``).
        clock: POSIX seconds now (the fetch time: no price is known after it).
        timeout_s: connect/read timeout of the default client, seconds.
    """

    name = AWS_SPOT
    kind = "cloud"
    unit = CLOUD_PRICE_UNIT

    def __init__(self, client_factory: Callable[[str], Any] | None = None, *, product: str = "Linux/UNIX",
                 clock: Callable[[], float] = time.time, timeout_s: float = 20.0):
        self._factory = client_factory or (lambda region: _aws_client("ec2", region, timeout_s))
        self._clients: dict[str, Any] = {}
        self.product = product
        self.clock = clock

    def _client(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = self._factory(region)
        return self._clients[region]

    def records(self, region: str, instance_types: Sequence[str], start_s: float,
                end_s: float) -> dict[tuple[str, str], list[tuple[float, float]]]:
        """Raw price changes of ``region``: ``(zone, instance type) -> [(POSIX s, USD/h), ...]`` (AWS order).

        Raises ``ValueError`` naming ``instance_types`` when empty; :class:`SourceError` for a feed fault
        (including a record whose ``SpotPrice`` is not a number > 0: an unreadable answer).
        """
        if not instance_types:
            raise ValueError("instance_types: empty; name at least one instance type")
        params = {"StartTime": datetime.fromtimestamp(start_s, tz=timezone.utc),
                  "EndTime": datetime.fromtimestamp(end_s, tz=timezone.utc),
                  "InstanceTypes": list(instance_types), "ProductDescriptions": [self.product]}
        out: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for page in _aws_pages(self.name, self._client(region), "describe_spot_price_history", params):
            for r in page.get("SpotPriceHistory", []):
                zone = r.get("AvailabilityZoneId") or r.get("AvailabilityZone")
                try:
                    price = float(r["SpotPrice"])
                    ts = r["Timestamp"].timestamp()
                except (KeyError, TypeError, ValueError, AttributeError):
                    raise SourceUnavailable(self.name, f"describe_spot_price_history: unreadable record in {region} "
                                            f"({r.get('InstanceType')!r} {zone!r})") from None
                if not (math.isfinite(price) and price > 0) or not zone:
                    raise SourceUnavailable(self.name, f"describe_spot_price_history: SpotPrice={r.get('SpotPrice')!r} "
                                            f"of {r.get('InstanceType')!r} in {zone!r} is not a price > 0")
                out.setdefault((str(zone), str(r["InstanceType"])), []).append((ts, price))
        return out

    def history(self, region: str, instance_types: Sequence[str], start_s: float,
                end_s: float) -> dict[tuple[str, str], CheckedSeries]:
        """Hourly spot prices of ``[start_s, end_s)`` in ``region``: ``(zone, instance type) -> CheckedSeries``
        (USD/h; hours after now are missing). A pair AWS has no record for is absent. Raises like :meth:`records`,
        and ``ValueError`` naming ``start_s`` when the window has no past part."""
        now = self.clock()
        if not min(end_s, now) > start_s:
            raise ValueError(f"start_s={start_s}: not before min(end_s={end_s}, now={now}): no past hour to ask for")
        recs = self.records(region, instance_types, start_s, min(end_s, now))
        return {k: step_to_hourly([t for t, _ in v], [p for _, p in v], start_s=start_s, end_s=end_s, until_s=now,
                                  zone=k[0], source=self.name) for k, v in recs.items()}


# --------------------------------------------------------------------------------------------- AWS price list
class AwsPriceList:
    """On-demand Linux prices of EC2 instance types from the AWS Price List Query API, USD/h (module docstring).

    Args:
        client: a ``pricing`` client (default: boto3 in ``us-east-1``, the API's endpoint, one attempt per call).
        timeout_s: connect/read timeout of the default client, seconds.
    """

    name = AWS_PRICE_LIST
    kind = "cloud"
    unit = CLOUD_PRICE_UNIT

    def __init__(self, client: Any = None, *, timeout_s: float = 20.0):
        self._client = client
        self._timeout_s = timeout_s

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _aws_client("pricing", "us-east-1", self._timeout_s)
        return self._client

    def on_demand(self, instance_types: Sequence[str], regions: Iterable[str] | None = None
                  ) -> dict[tuple[str, str], float]:
        """``(region, instance type) -> USD/h`` on demand (all regions AWS lists, or only ``regions``).

        Where AWS lists more than one matching product for a pair, the highest price is kept (the conservative
        reading; the filters should leave one). Raises ``ValueError`` naming ``instance_types`` when empty;
        :class:`SourceError` for a feed fault or a price document that cannot be read.
        """
        if not instance_types:
            raise ValueError("instance_types: empty; name at least one instance type")
        want = set(regions) if regions is not None else None
        out: dict[tuple[str, str], float] = {}
        for itype in instance_types:
            filters = [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": itype}]
            filters += [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in AWS_ON_DEMAND_FILTERS]
            params = {"ServiceCode": "AmazonEC2", "Filters": filters, "FormatVersion": "aws_v1"}
            for page in _aws_pages(self.name, self.client, "get_products", params):
                for doc in page.get("PriceList", []):
                    region, price = self._read(doc, itype)
                    if want is not None and region not in want:
                        continue
                    out[(region, itype)] = max(price, out.get((region, itype), 0.0))
        return out

    def _read(self, doc: Any, itype: str) -> tuple[str, float]:
        """(regionCode, USD/h) of one ``PriceList`` document (a JSON string or an already decoded mapping)."""
        try:
            d = json.loads(doc) if isinstance(doc, str) else doc
            region = str(d["product"]["attributes"]["regionCode"])
            prices = [float(dim["pricePerUnit"]["USD"]) for term in d["terms"]["OnDemand"].values()
                      for dim in term["priceDimensions"].values() if dim.get("unit") == "Hrs"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SourceUnavailable(self.name, f"get_products: unreadable price document for {itype!r}") from None
        if len(prices) != 1 or not (math.isfinite(prices[0]) and prices[0] > 0):
            raise SourceUnavailable(self.name, f"get_products: {itype!r} in {region!r} has {len(prices)} hourly "
                                    f"on-demand price(s) {prices!r}; expected one > 0")
        return region, prices[0]


# --------------------------------------------------------------------------------------------- GCP
_GCP_GPU = re.compile(r"^(?:Spot Preemptible )?Nvidia (.+?) GPU(?: attached to Spot Preemptible VMs)? running in ")
_GCP_HOST = re.compile(r"^(?:Spot Preemptible )?([A-Z][A-Z0-9]*)(?: Predefined| AMD| Arm)? Instance (Core|Ram) running in ")
_GCP_MARKETS = {"OnDemand": Market.on_demand, "Preemptible": Market.spot}
_GCP_UNITS = {"gpu": "h", "cpu": "h", "ram": "GiBy.h"}


@dataclass(frozen=True)
class GcpSku:
    """One priced Compute Engine SKU.

    Attributes:
        resource: ``"gpu"`` (per GPU-hour), ``"cpu"`` (per vCPU-hour) or ``"ram"`` (per GiB-hour).
        item: canonical GPU type (:func:`pricing.power.canonical_gpu_type`) for a GPU, the machine family
            (``n1``, ``a2``, ``g2`` ...) for a vCPU or RAM SKU.
        market: spot (``Preemptible``) or on-demand.
        regions: the SKU's ``serviceRegions``.
        usd_per_unit: USD per ``h`` (GPU, vCPU) or per ``GiBy.h`` (RAM).
        sku_id: the catalog's ``skuId``.
    """

    resource: str
    item: str
    market: Market
    regions: tuple[str, ...]
    usd_per_unit: float
    sku_id: str = ""


@dataclass
class GcpRates:
    """Per-unit Compute Engine rates by ``(resource, item, region, market)`` -> USD per unit (see :class:`GcpSku`).

    Attributes:
        rates: the table; ``skipped``: reason -> SKUs not used (commitments, other resources, unknown GPUs).
    """

    rates: dict[tuple[str, str, str, Market], float] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def instance_price(self, instance_type: str, region: str, market: Market | str) -> float:
        """USD/h of a GCP offer ``instance_type`` (``a2-highgpu-1g``, ``n1-standard-8+V100x1``) in ``region``:
        ``vCPUs x core + GiB x RAM`` of the host family plus ``GPUs x GPU``; host vCPUs and GiB from the bundled
        GCP catalog. ``NaN`` when a part has no rate. Raises ``ValueError`` naming ``instance_type`` if unknown."""
        from pricing.catalog import gcp_host_shape, gcp_offer_parts
        from pricing.power import canonical_gpu_type

        m = Market(market)
        host, acc, n = gcp_offer_parts(instance_type)
        vcpus, gib = gcp_host_shape(host)
        fam = host.split("-", 1)[0]
        parts = [self.rates.get(("cpu", fam, region, m)), self.rates.get(("ram", fam, region, m)),
                 self.rates.get(("gpu", canonical_gpu_type(acc), region, m))]
        if any(x is None for x in parts):
            return float("nan")
        return vcpus * parts[0] + gib * parts[1] + n * parts[2]


class GcpBillingCatalog:
    """Compute Engine GPU, vCPU and RAM rates from the Cloud Billing Catalog API (module docstring).

    Args:
        session: a ``requests.Session`` (default: ``google.auth.default`` credentials with the
            ``cloud-billing.readonly`` scope in an ``AuthorizedSession``; tests pass a plain session).
        base_url: the API root.
        page_size: ``pageSize`` per request (the API's maximum is 5000).
        timeout_s: per-request timeout, seconds.
    """

    name = GCP_BILLING_CATALOG
    kind = "cloud"
    unit = CLOUD_PRICE_UNIT

    def __init__(self, session: Any = None, *, base_url: str = "https://cloudbilling.googleapis.com",
                 page_size: int = 5000, timeout_s: float = 30.0):
        self._session = session
        self.base_url = base_url
        self.page_size = page_size
        self.timeout_s = timeout_s
        self._http: HttpJson | None = None

    def _get(self, params: dict[str, Any]) -> Any:
        if self._http is None:
            session = self._session
            if session is None:
                import google.auth
                from google.auth.transport.requests import AuthorizedSession

                try:
                    creds, _ = google.auth.default(scopes=[GCP_BILLING_SCOPE])
                except google.auth.exceptions.DefaultCredentialsError:
                    raise SourceAuthError(self.name, "no Google credentials in the google.auth chain "
                                          "(GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server)") from None
                session = AuthorizedSession(creds)
            self._http = HttpJson(self.name, self.base_url, session=session, timeout_s=self.timeout_s)
        from google.auth import exceptions as gax

        try:
            return self._http.get(f"/v1/{GCP_COMPUTE_SERVICE}/skus", params)
        except gax.TransportError:  # the token endpoint could not be reached
            raise SourceUnavailable(self.name, "GET skus: cannot reach Google's token endpoint") from None
        except gax.GoogleAuthError as e:  # RefreshError and kin: the credentials could not be used
            raise SourceAuthError(self.name, f"GET skus: {type(e).__name__} (check the Google credentials)") from None

    def skus(self) -> tuple[list[GcpSku], dict[str, int]]:
        """All GPU, vCPU and RAM SKUs of Compute Engine, every page; plus skipped reason -> count.

        Raises :class:`SourceError` for a feed fault or an unreadable page.
        """
        from pricing.fx import usd_per_unit
        from pricing.power import canonical_gpu_type
        from pricing.errors import UnknownCurrencyError, UnknownGpuTypeError

        out: list[GcpSku] = []
        skipped: dict[str, int] = {}
        token = ""
        seen_tokens: set[str] = set()
        while True:
            params = {"pageSize": self.page_size, "currencyCode": "USD"}
            if token:
                params["pageToken"] = token
            body = self._get(params)
            if not isinstance(body, dict):
                raise SourceUnavailable(self.name, "GET skus: the answer is not a JSON object")
            for sku in body.get("skus", []):
                try:
                    got = self._sku(sku, canonical_gpu_type, usd_per_unit)
                except (UnknownGpuTypeError, UnknownCurrencyError) as e:
                    reason = "unknown GPU type" if isinstance(e, UnknownGpuTypeError) else "unknown currency"
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                if isinstance(got, str):
                    skipped[got] = skipped.get(got, 0) + 1
                else:
                    out.append(got)
            token = str(body.get("nextPageToken") or "")
            if not token:
                return out, skipped
            if token in seen_tokens:
                raise SourceUnavailable(self.name, f"GET skus: pageToken {token!r} repeats (a paging loop)")
            seen_tokens.add(token)

    def _sku(self, sku: Any, canonical_gpu_type, usd_per_unit) -> GcpSku | str:
        """A :class:`GcpSku`, or the reason the SKU is skipped."""
        try:
            desc = str(sku["description"])
            usage = str(sku["category"]["usageType"])
            regions = tuple(str(r) for r in sku.get("serviceRegions", []))
        except (KeyError, TypeError):
            raise SourceUnavailable(self.name, "GET skus: a SKU without description/category") from None
        if usage not in _GCP_MARKETS:
            return "usage type not spot or on-demand"
        g = _GCP_GPU.match(desc)
        h = None if g else _GCP_HOST.match(desc)
        if g:
            resource, item = "gpu", canonical_gpu_type(g.group(1))
        elif h:
            resource, item = ("cpu" if h.group(2) == "Core" else "ram"), h.group(1).lower()
        else:
            return "not a GPU, vCPU or RAM SKU"
        try:
            info = max(sku["pricingInfo"], key=lambda p: str(p.get("effectiveTime", "")))
            expr = info["pricingExpression"]
            tier = max(expr["tieredRates"], key=lambda r: float(r.get("startUsageAmount", 0)))
            price = tier["unitPrice"]
            amount = (int(price.get("units", 0) or 0) * 10**9 + int(price.get("nanos", 0) or 0)) / 1e9  # one rounding
            unit = str(expr["usageUnit"])
            rate = usd_per_unit(str(price.get("currencyCode", "USD")))
        except (KeyError, TypeError, ValueError):
            raise SourceUnavailable(self.name, f"GET skus: unreadable price of SKU {sku.get('skuId')!r}") from None
        if unit != _GCP_UNITS[resource]:
            return f"usage unit not {_GCP_UNITS[resource]}"
        if not amount > 0:
            return "price not > 0"
        return GcpSku(resource, item, _GCP_MARKETS[usage], regions, amount * rate, str(sku.get("skuId", "")))

    def rates(self, regions: Iterable[str] | None = None) -> GcpRates:
        """:meth:`skus` as a :class:`GcpRates` table (only ``regions`` when given). Two SKUs for one key: the
        higher rate is kept (the conservative reading). Raises like :meth:`skus`."""
        want = set(regions) if regions is not None else None
        skus, skipped = self.skus()
        out = GcpRates(skipped=skipped)
        for s in skus:
            for r in s.regions:
                if want is not None and r not in want:
                    continue
                k = (s.resource, s.item, r, s.market)
                out.rates[k] = max(s.usd_per_unit, out.rates.get(k, 0.0))
        return out


# --------------------------------------------------------------------------------------------- re-pricing
@dataclass(frozen=True)
class LivePrice:
    """A live price: ``usd_per_hour`` (USD/h), its ``source`` name and ``as_of_s`` (POSIX s it was fetched)."""

    usd_per_hour: float
    source: str
    as_of_s: float


@dataclass(frozen=True)
class PriceOrigin:
    """Where a re-priced offer's ``usd_per_hour`` came from.

    Attributes:
        price_source: a live source name, or :data:`BUNDLED_CATALOG` (the fallback).
        as_of_s: POSIX s the live price was fetched (``None`` for the bundled catalog).
        age_s: seconds between ``as_of_s`` and the hour priced (``None`` for the bundled catalog).
        estimated: True for a partly covered spot hour (:func:`step_to_hourly`).
    """

    price_source: str
    as_of_s: float | None = None
    age_s: float | None = None
    estimated: bool = False

    @property
    def fallback(self) -> bool:
        """True when the bundled catalog price was kept."""
        return self.price_source == BUNDLED_CATALOG


@dataclass
class CloudPriceBook:
    """Live cloud prices as fetched, looked up per offer and hour.

    Attributes:
        aws_spot: ``(zone, instance type) -> hourly CheckedSeries`` (:meth:`AwsSpotPrices.history`).
        aws_spot_fetched_s: POSIX s of that fetch.
        aws_on_demand: ``(region, instance type) -> USD/h`` (:meth:`AwsPriceList.on_demand`).
        aws_on_demand_fetched_s: POSIX s of that fetch.
        gcp: the :class:`GcpRates` table (or ``None``); gcp_fetched_s: POSIX s of that fetch.
    """

    aws_spot: dict[tuple[str, str], CheckedSeries] = field(default_factory=dict)
    aws_spot_fetched_s: float | None = None
    aws_on_demand: dict[tuple[str, str], float] = field(default_factory=dict)
    aws_on_demand_fetched_s: float | None = None
    gcp: GcpRates | None = None
    gcp_fetched_s: float | None = None

    def price(self, offer: CloudOffer, hour_s: float) -> tuple[LivePrice, bool] | None:
        """The live price of ``offer`` in the UTC hour holding ``hour_s`` and its estimated flag, or ``None``
        when the book has no finite price > 0 for it."""
        got: tuple[float, str, float | None, bool] | None = None
        if offer.provider == "aws" and offer.market is Market.spot:
            c = self.aws_spot.get((offer.zone, offer.instance_type))
            if c is not None:
                s = c.series
                i = int(math.floor((hour_s - s.start_s) / s.interval_s))
                if 0 <= i < s.values.size:
                    got = (float(s.values[i]), AWS_SPOT, self.aws_spot_fetched_s, bool(c.estimated[i]))
        elif offer.provider == "aws":
            v = self.aws_on_demand.get((offer.region, offer.instance_type))
            if v is not None:
                got = (v, AWS_PRICE_LIST, self.aws_on_demand_fetched_s, False)
        elif offer.provider == "gcp" and self.gcp is not None:
            got = (self.gcp.instance_price(offer.instance_type, offer.region, offer.market), GCP_BILLING_CATALOG,
                   self.gcp_fetched_s, False)
        if got is None or got[2] is None or not (math.isfinite(got[0]) and got[0] > 0):
            return None
        return LivePrice(got[0], got[1], got[2]), got[3]


def live_source_for(offer: CloudOffer) -> str:
    """The live source that prices ``offer``: :data:`AWS_SPOT` (AWS spot), :data:`AWS_PRICE_LIST` (AWS on-demand)
    or :data:`GCP_BILLING_CATALOG` (GCP, both markets)."""
    if offer.provider == "aws":
        return AWS_SPOT if offer.market is Market.spot else AWS_PRICE_LIST
    return GCP_BILLING_CATALOG


@dataclass
class OfferPrices:
    """Live prices already resolved per offer: ``prices`` maps ``offer_id`` -> ``(LivePrice, estimated)``
    (what the live broker reads back from its cache); :meth:`price` has :meth:`CloudPriceBook.price`'s contract."""

    prices: dict[str, tuple[LivePrice, bool]] = field(default_factory=dict)

    def price(self, offer: CloudOffer, now_s: float) -> tuple[LivePrice, bool] | None:
        """The live price of ``offer`` (the same for any ``now_s``: resolved when read), or ``None``."""
        got = self.prices.get(offer.offer_id)
        if got is None or not (math.isfinite(got[0].usd_per_hour) and got[0].usd_per_hour > 0):
            return None
        return got


def reprice_offers(offers: Sequence[CloudOffer], book: CloudPriceBook | OfferPrices, now_s: float
                   ) -> list[tuple[CloudOffer, PriceOrigin]]:
    """Each offer priced for the UTC hour holding ``now_s`` (POSIX s) from ``book``, in input order.

    An offer the book has a live price for gets that ``usd_per_hour`` (USD/h) and a :class:`PriceOrigin`
    naming the source and its age (``now_s - as_of_s``, seconds); every other offer keeps its bundled
    catalog price, flagged :data:`BUNDLED_CATALOG`. A price is never 0: a live price that is not finite and
    > 0 counts as none.
    """
    out = []
    for o in offers:
        got = book.price(o, now_s)
        if got is None:
            out.append((o, PriceOrigin(BUNDLED_CATALOG)))
            continue
        lp, est = got
        out.append((o.model_copy(update={"usd_per_hour": lp.usd_per_hour}),
                    PriceOrigin(lp.source, lp.as_of_s, round(now_s - lp.as_of_s, 3), est)))
    return out
