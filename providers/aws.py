"""AWS EC2 adapter: :class:`AwsCompute` (``Compute`` + quota preflight + orphan sweep).

One boto3 EC2 client per region (``boto3.client("ec2", region_name=..., endpoint_url=...)``),
made lazily and cached; tests inject ``region_clients`` (a botocore ``Stubber``-wrapped client)
or ``endpoint_url`` (a moto server).

Launch (ARCHITECTURE.md §5)
    ``run_instances`` with ``MinCount = MaxCount = 1`` and ``ClientToken = req.token``: EC2 itself
    makes a retried create return the same instance. The instance and its volumes are tagged at
    creation (``req.tags`` + ``Name`` + ``fedbroker-token``), IMDSv2 is required
    (``HttpTokens=required``, hop limit 1: containers cannot reach the instance role's credentials; the spot-notice watcher runs on the host;
    instance tags readable from IMDS),
    spot is ``one-time`` with ``terminate`` on interruption. Before ``run_instances`` the adapter
    looks the token up (``tag:fedbroker-token`` and ``tag:fedbroker-broker``, live states) and returns a live instance it finds: that is the
    "create (or find, by token)" of :meth:`Compute.launch`, it needs no ``client-token`` filter
    (moto has none) and costs one ``DescribeInstances`` call.

Error mapping (botocore ``ClientError`` code -> typed error; every error has ``option=req.offer_id``
and ``code`` = the EC2 code)::

    InsufficientInstanceCapacity, InsufficientCapacity,
    InsufficientHostCapacity, SpotMaxPriceTooLow          -> NoCapacity
    VcpuLimitExceeded, MaxSpotInstanceCountExceeded,
    InstanceLimitExceeded                                  -> QuotaExceeded
    Unsupported, InvalidParameterValue/Combination about
    the instance type or zone, InvalidAMIID.*              -> Unsupported
    RequestLimitExceeded, Throttling, ThrottlingException  -> Throttled
    IdempotentParameterMismatch                            -> ProviderError (same token, other parameters)
    anything else (and BotoCoreError: network, creds)      -> ProviderError

Quota preflight
    EC2 on-demand and spot limits are vCPU buckets per region and instance family. The codes are the
    Service Quotas codes of service ``ec2`` (AWS Service Quotas console -> Amazon Elastic Compute
    Cloud (Amazon EC2), and the EC2 User Guide "On-Demand Instance quotas" / "Spot Instance quotas")::

        L-417A185B  Running On-Demand P instances
        L-7212CCBC  All P Spot Instance Requests
        L-DB2E81BA  Running On-Demand G and VT instances
        L-3819A6DF  All G and VT Spot Instance Requests

    ``preflight`` = quota - vCPUs of this account's pending/running instances of that bucket in the
    region (all instances, not only ours) must be >= the type's default vCPUs
    (``describe_instance_types``). Instance types of other families have no check. The quota source is
    injectable (``quota_source(region, quota_code) -> vCPUs | None``); the default asks Service Quotas
    (applied value, else the AWS default) and returns ``None`` (no check) when it cannot tell.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from providers.base import (
    check_outputs,
    MANAGED_TAG,
    Compute,
    InstanceInfo,
    InstanceRequest,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    SupportsQuotaPreflight,
    SupportsSweep,
    Throttled,
    Unsupported,
)

__all__ = ["QUOTA_CODES", "TOKEN_TAG", "AwsCompute", "map_client_error", "quota_bucket", "compute_from_settings",
           "offer_in_network", "settings_from_terraform", "TERRAFORM_OUTPUTS"]

log = logging.getLogger(__name__)

#: tag holding the idempotency token, so a retried launch finds the instance of its first try
TOKEN_TAG = "fedbroker-token"

#: states of an instance that still exists (list_managed, token lookup, quota usage)
LIVE_STATES = ["pending", "running", "stopping", "stopped"]
#: an availability zone ID (``use1-az1``, ``usw2-lax1-az1``) rather than a zone name (``us-east-1a``)
AZ_ID_RE = re.compile(r"^[a-z]{2,6}[0-9]+(-[a-z0-9]+)?-az[0-9]+$")

#: (bucket, market) -> Service Quotas code (service ``ec2``), vCPUs
QUOTA_CODES: dict[tuple[str, str], str] = {
    ("P", "on_demand"): "L-417A185B",
    ("P", "spot"): "L-7212CCBC",
    ("G", "on_demand"): "L-DB2E81BA",
    ("G", "spot"): "L-3819A6DF",
}

_NO_CAPACITY = {"InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
                "InsufficientReservedInstanceCapacity", "SpotMaxPriceTooLow"}
_QUOTA = {"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded"}
_THROTTLED = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"}
_UNSUPPORTED = {"Unsupported", "UnsupportedOperation", "InvalidInstanceType"}
_NOT_FOUND = {"InvalidInstanceID.NotFound"}

_STATE = {"pending": "pending", "running": "running", "stopping": "stopping", "stopped": "stopped",
          # on its way to terminated: for the broker the machine is gone
          "shutting-down": "terminated", "terminated": "terminated"}


def map_client_error(exc: ClientError, option: str | None) -> ProviderError:
    """The typed error for an EC2 ``ClientError`` (see the module docstring)."""
    err = exc.response.get("Error", {}) if hasattr(exc, "response") else {}
    code = err.get("Code") or "Unknown"
    msg = err.get("Message") or str(exc)
    text = f"{code}: {msg}"
    if code in _NO_CAPACITY:
        return NoCapacity(text, option, code)
    if code in _QUOTA:
        return QuotaExceeded(text, option, code)
    if code in _THROTTLED:
        return Throttled(text, option, code)
    if code in _UNSUPPORTED or code.startswith("InvalidAMIID"):
        return Unsupported(text, option, code)
    if code in ("InvalidParameterValue", "InvalidParameterCombination") and re.search(
            r"instance ?type|availability zone|not supported", msg, re.IGNORECASE):
        return Unsupported(text, option, code)
    if code == "IdempotentParameterMismatch":
        return ProviderError(f"{text} (the same ClientToken was used before with different parameters; "
                             "the token must be derived from job, attempt, offer and rank)", option, code)
    if code in _NOT_FOUND:
        return ProviderError(text, option, "NotFound")
    return ProviderError(text, option, code)


def _map(exc: Exception, option: str | None) -> ProviderError:
    if isinstance(exc, ClientError):
        return map_client_error(exc, option)
    return ProviderError(f"{type(exc).__name__}: {exc}", option, type(exc).__name__)


def instance_family(instance_type: str) -> str:
    """``p4d.24xlarge`` -> ``p``; ``g5.xlarge`` -> ``g``; ``vt1.3xlarge`` -> ``vt``; ``gr6.4xlarge`` -> ``gr``."""
    m = re.match(r"([a-z]+)", instance_type.lower())
    return m.group(1) if m else ""


def quota_bucket(instance_type: str) -> str | None:
    """EC2 vCPU quota bucket of an instance type: ``"P"``, ``"G"`` (G and VT) or ``None`` (not checked)."""
    fam = instance_family(instance_type)
    if fam == "p":
        return "P"
    if fam in ("g", "gr", "vt"):
        return "G"
    return None


def _tags(d: dict[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in d.items()]


class AwsCompute(Compute, SupportsQuotaPreflight, SupportsSweep):
    """EC2 adapter.

    Args:
        region_clients: ``region -> EC2 client``; default ``boto3.client("ec2", region_name=region,
            endpoint_url=endpoint_url)`` (standard retry mode, 3 attempts), cached per region.
        endpoint_url: EC2 (and Service Quotas) endpoint, e.g. a moto server in tests.
        ami_by_region: default image per region (``req.image`` wins).
        security_group_by_region: security group id per region (optional).
        subnet_by_zone: subnet id per availability zone (optional; default VPC's subnet otherwise).
        key_name: EC2 key pair (optional).
        instance_profile: IAM instance profile name or ARN (optional).
        regions: regions ``list_managed`` / ``sweep`` look in; default: those named in
            ``ami_by_region``, ``security_group_by_region`` and ``subnet_by_zone``.
        quota_source: ``(region, quota_code) -> vCPU limit | None`` for :meth:`preflight`.
        launch_template_by_region: launch template id per region; ``RunInstances`` starts from it (root
            volume size, type and KMS encryption), every field set here overrides it.
        region_by_zone: region of each zone name or AZ ID (``use1-az1``); price catalogs (SkyPilot's)
            name zones by AZ ID, which is the same physical zone in every account, unlike ``us-east-1a``.
        placement_group_by_region: cluster placement group per region; instances of a gang of more
            than one node (``req.gang_size > 1``) are launched into it (NCCL/EFA bandwidth).
        instance_profile_by_region: IAM instance profile per region (wins over ``instance_profile``).
    """

    name = "aws"
    #: DescribeInstances page size (MaxResults, 5..1000) for list_managed, sweep, preflight, token lookup
    page_size = 500

    def __init__(self, region_clients: Callable[[str], Any] | None = None, endpoint_url: str | None = None,
                 ami_by_region: dict[str, str] | None = None,
                 security_group_by_region: dict[str, str] | None = None,
                 subnet_by_zone: dict[str, str] | None = None, key_name: str | None = None,
                 instance_profile: str | None = None, regions: Iterable[str] | None = None,
                 quota_source: Callable[[str, str], float | None] | None = None,
                 placement_group_by_region: dict[str, str] | None = None,
                 instance_profile_by_region: dict[str, str] | None = None,
                 region_by_zone: dict[str, str] | None = None,
                 launch_template_by_region: dict[str, str] | None = None):
        self._factory = region_clients
        self.endpoint_url = endpoint_url
        self.ami_by_region = dict(ami_by_region or {})
        self.security_group_by_region = dict(security_group_by_region or {})
        self.subnet_by_zone = dict(subnet_by_zone or {})
        self.key_name = key_name
        self.instance_profile = instance_profile
        #: cluster placement group per region (terraform/aws ``placement_group_name``) for gangs of > 1 node
        self.placement_group_by_region = dict(placement_group_by_region or {})
        #: IAM instance profile per region (overrides ``instance_profile`` there)
        self.instance_profile_by_region = dict(instance_profile_by_region or {})
        #: zone (name or AZ ID) -> region, for zones whose name does not start with the region (``use1-az1``)
        self.region_by_zone = dict(region_by_zone or {})
        #: launch template per region (terraform/aws ``launch_template_id``): what RunInstances does not set
        self.launch_template_by_region = dict(launch_template_by_region or {})
        if regions is None:
            found = set(self.ami_by_region) | set(self.security_group_by_region)
            found |= {self._zone_region(z, found) for z in self.subnet_by_zone}
            regions = sorted(found)
        self.regions = list(regions)
        self.quota_source = quota_source or self._service_quota
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()
        self._vcpus: dict[str, int] = {}

    # -- clients ---------------------------------------------------------------------------------

    def client(self, region: str) -> Any:
        """The EC2 client of ``region`` (made once)."""
        with self._clients_lock:  # ranks of a gang are created from several threads
            c = self._clients.get(region)
            if c is None:
                if self._factory is not None:
                    c = self._factory(region)
                else:
                    c = boto3.client("ec2", region_name=region, endpoint_url=self.endpoint_url,
                                     config=Config(retries={"mode": "standard", "max_attempts": 3}))
                self._clients[region] = c
            return c

    @staticmethod
    def _zone_region(zone: str, known: Iterable[str] = ()) -> str:
        """``us-east-1a`` -> ``us-east-1``; a Local Zone (``us-west-2-lax-1a``) -> its parent if known."""
        for r in sorted(known, key=len, reverse=True):
            if zone.startswith(r):
                return r
        return zone[:-1] if zone and zone[-1].isalpha() else zone

    def region_of(self, zone: str) -> str:
        """The region of availability zone ``zone`` (e.g. ``us-east-1a`` -> ``us-east-1``; an AZ ID such as
        ``use1-az1`` through ``region_by_zone``)."""
        return self.region_by_zone.get(zone) or self._zone_region(zone, self.regions)

    # -- Compute ---------------------------------------------------------------------------------

    def launch(self, req: InstanceRequest) -> InstanceInfo:
        region = req.region or self.region_of(req.zone)
        image = req.image or self.ami_by_region.get(region)
        if not image:
            raise Unsupported(f"no machine image configured for region {region}", req.offer_id, "NoImage")
        ec2 = self.client(region)
        found = self._find_by_token(ec2, req)
        if found is not None:
            return found
        tags = {"Name": f"fedbroker-{req.job_id}-{req.attempt}-{req.rank}", **req.tags, TOKEN_TAG: req.token}
        params: dict[str, Any] = {
            "MinCount": 1, "MaxCount": 1,
            "InstanceType": req.instance_type,
            "ImageId": image,
            "UserData": req.user_data,  # botocore base64-encodes it
            "ClientToken": req.token,
            "Placement": ({"AvailabilityZoneId": req.zone} if AZ_ID_RE.match(req.zone)
                          else {"AvailabilityZone": req.zone}),
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1,
                                "InstanceMetadataTags": "enabled"},
            "TagSpecifications": [{"ResourceType": "instance", "Tags": _tags(tags)},
                                  {"ResourceType": "volume", "Tags": _tags(tags)}],
            "InstanceInitiatedShutdownBehavior": "terminate",
        }
        if req.market == "spot":
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        subnet = self.subnet_by_zone.get(req.zone)
        if subnet:
            params["SubnetId"] = subnet
            if AZ_ID_RE.match(req.zone):  # the subnet fixes the zone; not every endpoint knows AvailabilityZoneId
                params["Placement"].pop("AvailabilityZoneId")
        sg = self.security_group_by_region.get(region)
        if sg:
            params["SecurityGroupIds"] = [sg]
        if self.key_name:
            params["KeyName"] = self.key_name
        profile = self.instance_profile_by_region.get(region) or self.instance_profile
        if profile:
            key = "Arn" if profile.startswith("arn:") else "Name"
            params["IamInstanceProfile"] = {key: profile}
        template = self.launch_template_by_region.get(region)
        if template:  # root volume size/type/encryption (KMS) from terraform/aws; the fields above override it
            params["LaunchTemplate"] = {"LaunchTemplateId": template}
        group = self.placement_group_by_region.get(region)
        if group and req.gang_size > 1:  # NCCL/EFA between the gang's nodes: one cluster placement group
            params["Placement"]["GroupName"] = group
        try:
            resp = ec2.run_instances(**params)
        except (ClientError, BotoCoreError) as exc:
            raise _map(exc, req.offer_id) from exc
        return self._info(resp["Instances"][0])

    def describe(self, instance_id: str, zone: str) -> InstanceInfo:
        ec2 = self.client(self.region_of(zone))
        try:
            resp = ec2.describe_instances(InstanceIds=[instance_id])
        except (ClientError, BotoCoreError) as exc:
            raise _map(exc, None) from exc
        for r in resp.get("Reservations", []):
            for i in r.get("Instances", []):
                return self._info(i)
        raise ProviderError(f"instance {instance_id} not found", None, "NotFound")

    def terminate(self, instance_id: str, zone: str) -> None:
        ec2 = self.client(self.region_of(zone))
        try:
            ec2.terminate_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            err = map_client_error(exc, None)
            if err.code == "NotFound":
                return  # already gone (or never existed): terminate is idempotent
            raise err from exc
        except BotoCoreError as exc:
            raise _map(exc, None) from exc

    def list_managed(self, broker_id: str) -> list[InstanceInfo]:
        out: list[InstanceInfo] = []
        filters = [{"Name": f"tag:{MANAGED_TAG}", "Values": [broker_id]},
                   {"Name": "instance-state-name", "Values": LIVE_STATES}]
        for region in self.regions:
            out.extend(self._describe_all(self.client(region), filters))
        return out

    # -- preflight -------------------------------------------------------------------------------

    def quota_family(self, instance_type: str) -> str:
        """Quota scope of a type for the provisioner: the vCPU bucket (``P``, ``G``) or the family."""
        return quota_bucket(instance_type) or instance_family(instance_type)

    def preflight(self, req: InstanceRequest) -> None:
        """Raise :class:`QuotaExceeded` if the region's vCPU bucket of the type cannot hold one more.

        The error has ``code`` = the quota code and ``quota``, ``in_use``, ``needed`` (vCPUs)."""
        bucket = quota_bucket(req.instance_type)
        market = "spot" if req.market == "spot" else "on_demand"
        if bucket is None:
            return
        code = QUOTA_CODES[(bucket, market)]
        region = req.region or self.region_of(req.zone)
        limit = self.quota_source(region, code)
        if limit is None:
            return
        ec2 = self.client(region)
        try:
            needed = self.vcpus(ec2, [req.instance_type])[req.instance_type]
            running = self._describe_all(ec2, [{"Name": "instance-state-name", "Values": ["pending", "running"]}])
            in_bucket = [i for i in running if quota_bucket(i.instance_type) == bucket
                         and (i.spot == (market == "spot"))]
            sizes = self.vcpus(ec2, sorted({i.instance_type for i in in_bucket}))
        except ProviderError as exc:
            log.warning("aws preflight for %s skipped: %s", req.offer_id, exc)
            return
        in_use = sum(sizes.get(i.instance_type, 0) for i in in_bucket)
        if in_use + needed > limit:
            err = QuotaExceeded(
                f"{code} ({bucket} {market} vCPUs in {region}): quota {limit:g}, in use {in_use}, "
                f"{req.instance_type} needs {needed}", req.offer_id, code)
            err.quota, err.in_use, err.needed = limit, in_use, needed  # type: ignore[attr-defined]
            raise err

    def vcpus(self, ec2: Any, instance_types: list[str]) -> dict[str, int]:
        """Default vCPUs of each type (``describe_instance_types``), cached."""
        missing = [t for t in instance_types if t not in self._vcpus]
        for i in range(0, len(missing), 100):
            try:
                resp = ec2.describe_instance_types(InstanceTypes=missing[i:i + 100])
            except (ClientError, BotoCoreError) as exc:
                raise _map(exc, None) from exc
            for t in resp.get("InstanceTypes", []):
                self._vcpus[t["InstanceType"]] = int(t["VCpuInfo"]["DefaultVCpus"])
        return {t: self._vcpus[t] for t in instance_types if t in self._vcpus}

    def _service_quota(self, region: str, code: str) -> float | None:
        """The applied quota value (else the AWS default) from Service Quotas; ``None`` if unknown."""
        try:
            sq = boto3.client("service-quotas", region_name=region, endpoint_url=self.endpoint_url)
            try:
                return float(sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchResourceException":
                    raise
                return float(sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except Exception as exc:  # noqa: BLE001 - preflight is advisory; the create call still classifies
            log.warning("service quota %s in %s unknown: %s", code, region, exc)
            return None

    # -- helpers ---------------------------------------------------------------------------------

    def _find_by_token(self, ec2: Any, req: InstanceRequest) -> InstanceInfo | None:
        try:
            filters = [{"Name": f"tag:{TOKEN_TAG}", "Values": [req.token]}]
            if MANAGED_TAG in req.tags:
                filters.append({"Name": f"tag:{MANAGED_TAG}", "Values": [req.tags[MANAGED_TAG]]})
            filters.append({"Name": "instance-state-name", "Values": LIVE_STATES})
            found = self._describe_all(ec2, filters)
        except ProviderError as exc:
            if exc.option is None:
                exc.option = req.offer_id
            raise
        return found[0] if found else None

    def _describe_all(self, ec2: Any, filters: list[dict[str, Any]]) -> list[InstanceInfo]:
        out = []
        try:
            pages = ec2.get_paginator("describe_instances").paginate(
                Filters=filters, PaginationConfig={"PageSize": self.page_size})
            for page in pages:
                for r in page.get("Reservations", []):
                    out.extend(self._info(i) for i in r.get("Instances", []))
        except (ClientError, BotoCoreError) as exc:
            raise _map(exc, None) from exc
        return out

    def _info(self, i: dict[str, Any]) -> InstanceInfo:
        return InstanceInfo(
            provider="aws",
            instance_id=i["InstanceId"],
            zone=i.get("Placement", {}).get("AvailabilityZone", ""),
            instance_type=i.get("InstanceType", ""),
            state=_STATE.get(i.get("State", {}).get("Name", ""), "unknown"),
            private_ip=i.get("PrivateIpAddress"),
            tags={t["Key"]: t["Value"] for t in i.get("Tags", [])},
            launched_at=i.get("LaunchTime"),
            spot=i.get("InstanceLifecycle") == "spot",
        )


# ---------------------------------------------------------------------- registry functions (providers.registry)
#: terraform output name -> settings key (terraform/aws/outputs.tf, per region)
TERRAFORM_OUTPUTS = {"ami_id": "ami_id", "subnet_ids_by_az": "subnet_ids_by_az",
                     "subnet_ids_by_az_id": "subnet_ids_by_az_id", "security_group_id": "security_group_id",
                     "placement_group_name": "placement_group_name", "instance_profile_name": "instance_profile_name",
                     "launch_template_id": "launch_template_id"}


def compute_from_settings(section: Any) -> AwsCompute:
    """The adapter for the broker's ``aws`` settings section (``endpoint_url``, ``key_name`` and ``regions``:
    region -> ``ami_id``, ``security_group_id``, ``subnet_ids_by_az`` / ``subnet_ids_by_az_id`` (zone name or
    zone ID -> subnet), ``placement_group_name``, ``instance_profile_name``, ``launch_template_id``)."""
    regions = section.regions
    return AwsCompute(
        endpoint_url=section.endpoint_url, regions=sorted(regions),
        ami_by_region={r: c.ami_id for r, c in regions.items()},
        security_group_by_region={r: c.security_group_id for r, c in regions.items() if c.security_group_id},
        subnet_by_zone={z: sub for c in regions.values() for z, sub in {**c.subnet_ids_by_az, **c.subnet_ids_by_az_id}.items()},
        region_by_zone={z: r for r, c in regions.items() for z in {**c.subnet_ids_by_az, **c.subnet_ids_by_az_id}},
        key_name=section.key_name,
        placement_group_by_region={r: c.placement_group_name for r, c in regions.items() if c.placement_group_name},
        instance_profile_by_region={r: c.instance_profile_name for r, c in regions.items() if c.instance_profile_name},
        launch_template_by_region={r: c.launch_template_id for r, c in regions.items() if c.launch_template_id})


def offer_in_network(section: Any, offer: Any) -> bool:
    """Whether ``offer``'s zone has a subnet in the ``aws`` settings section (``subnet_ids_by_az`` or
    ``subnet_ids_by_az_id`` of its region)."""
    reg = section.regions.get(offer.region)
    return reg is not None and (offer.zone in reg.subnet_ids_by_az or offer.zone in reg.subnet_ids_by_az_id)


def settings_from_terraform(files: list[tuple[Any, dict]]) -> dict:
    """The ``aws`` settings section (``{"regions": {region: {...}}}``) for ``[(path, outputs)]``: one
    ``terraform output -json`` of ``terraform/aws`` per region (its ``region`` output keys it). Raises
    ``ValueError`` naming the file and the missing, null or repeated output."""
    regions: dict[str, dict] = {}
    for f, out in files:
        check_outputs(f, out, ("region", "ami_id", "subnet_ids_by_az"), (), "terraform/aws")
        region = out.get("region")
        if not isinstance(region, str) or not region:
            raise ValueError(f"{f}: output 'region' is missing (terraform/aws outputs it)")
        if region in regions:
            raise ValueError(f"{f}: region {region!r} is given twice")
        check_outputs(f, out, (), ("ami_id", "subnet_ids_by_az"), "terraform/aws")
        regions[region] = {key: out[name] for name, key in TERRAFORM_OUTPUTS.items() if out.get(name) is not None}
    return {"regions": regions}
