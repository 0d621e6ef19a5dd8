"""Google Compute Engine adapter (``google-cloud-compute``, REST transport).

:class:`GcpCompute` implements :class:`providers.base.Compute` (+ :class:`SupportsQuotaPreflight`,
:class:`SupportsSweep`) on GCE VMs.

Idempotency. The instance name is derived from the request's idempotency token
(``fb-`` + the first 20 hex digits of ``req.token``, see :func:`instance_name`), and the insert carries
``requestId = as_uuid(req.token)``. So a create retried after a crash or a timeout either gets the
same operation back (GCE de-duplicates a requestId for a while) or hits the existing name
(HTTP 409 ``alreadyExists`` / operation error ``RESOURCE_ALREADY_EXISTS``), which the adapter
answers by returning the instance it finds by that name. Different ranks have different tokens.

Waiting. The insert's zonal operation is waited for with ``zoneOperations.wait`` (our own
``ZoneOperationsClient``: the ``ExtendedOperation`` that ``InstancesClient.insert`` returns polls
through a client the transport builds itself, which ignores ``api_endpoint``, so it is not used)
for at most ``op_timeout_s``. A timeout is not a failure: the adapter then looks the instance up by
name and returns it (state ``pending``); only if it does not exist yet does ``launch`` raise
``ProviderError(code="OperationTimeout")`` (a retry with the same token is safe; an instance the
operation makes later still carries our labels, so the sweep finds it).

Machine types and GPUs. ``machineType = zones/{zone}/machineTypes/{instance_type}``. Families with
built-in GPUs (``a2``, ``a3``, ``a4``, ``g2``) need no ``guestAccelerators``. ``n1`` types get
``guestAccelerators = [{acceleratorType: zones/{zone}/acceleratorTypes/<name>, acceleratorCount:
req.gpu_count}]`` with the canonical type mapped by :data:`GCE_ACCELERATORS` (``T4 ->
nvidia-tesla-t4``, ``V100 -> nvidia-tesla-v100``, ``P100 -> nvidia-tesla-p100``, ``P4 ->
nvidia-tesla-p4``; ``A100 -> nvidia-tesla-a100``, ``A100-80GB -> nvidia-a100-80gb``, ``L4 ->
nvidia-l4``, ``H100 -> nvidia-h100-80gb`` are the built-in types of a2/g2/a3 and cannot be
attached to n1). A GPU that cannot be attached to the requested family raises :class:`Unsupported`
before any API call. Every GPU VM has ``scheduling.onHostMaintenance = TERMINATE`` (GCE refuses live
migration with GPUs).

Spot. ``market == "spot"`` -> ``scheduling.provisioningModel = SPOT``,
``instanceTerminationAction = DELETE``, ``automaticRestart = false``. What GCE does on preemption:
it sends ACPI G2 soft-off (~30 s notice; the metadata server's ``instance/preempted`` turns TRUE),
then, with action DELETE, deletes the VM (with STOP it goes ``TERMINATED`` and its disks keep
billing); in both cases the zone's operation list gets an operation with ``operationType =
compute.instances.preempted`` targeting the VM. :meth:`GcpCompute.was_preempted` reads that list.

Labels. ``req.tags`` become GCE labels. GCE label rules: keys and values at most 63 characters of
lowercase letters, digits, ``_`` and ``-``; keys start with a letter. :func:`label_key` /
:func:`label_value` lowercase, replace any other character by ``_``, prefix ``k`` to a key not
starting with a letter, and truncate to 63. Because that is lossy, the exact tags are also stored as
JSON in the instance metadata key ``fedbroker-tags``, and :class:`InstanceInfo.tags` is read back
from there (so the sweep compares exact job ids); labels serve the server-side filter.

Metadata. ``startup-script = req.user_data`` (run as root at every boot by the guest environment),
``install-nvidia-driver = True`` (honoured by Deep Learning VM images, ignored by others),
``fedbroker-tags`` as above.

Error mapping (each error carries ``option = req.offer_id`` and ``code``; GCE reports capacity and
quota mostly *in the finished operation* (HTTP 200 insert, ``error.errors[].code``), argument
errors and rate limits as HTTP errors (``google.api_core.exceptions``) on the insert itself)::

    ZONE_RESOURCE_POOL_EXHAUSTED, ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS,
      "does not have enough resources available"                     -> NoCapacity
    QUOTA_EXCEEDED (operation), HTTP 403 reason quotaExceeded        -> QuotaExceeded
    HTTP 429, reason rateLimitExceeded / userRateLimitExceeded (also on 403),
      RESOURCE_OPERATION_RATE_EXCEEDED                               -> Throttled (retry_after_s from Retry-After)
    HTTP 400 (invalid machine type / accelerator / image in zone), HTTP 404 on insert,
      UNSUPPORTED_OPERATION, RESOURCE_NOT_FOUND, INVALID_FIELD_VALUE -> Unsupported
    anything else                                                    -> ProviderError

``code`` is the operation's error code, else the HTTP error's ``reason``, else ``HTTP <status>``.

States: ``PROVISIONING``, ``STAGING``, ``REPAIRING`` -> pending; ``RUNNING`` -> running;
``STOPPING``, ``SUSPENDING`` -> stopping; ``TERMINATED`` (GCE's "stopped"), ``STOPPED``,
``SUSPENDED`` -> stopped; a deleted instance -> ``ProviderError(code="NotFound")`` from describe.
``list_managed`` returns stopped (TERMINATED) instances too: their disks still bill, so the sweep
must see them.

Quota preflight
    GCE GPU quotas are *regional* allocation quotas, one metric per GPU model and provisioning model,
    counted in GPUs (source: Google Cloud docs, Compute Engine "GPU quota" and "Allocation quotas";
    the names are what ``regions.get`` returns in ``Region.quotas[].metric``, and most are also in
    ``compute_v1.Quota.Metric``)::

        nvidia-tesla-t4       NVIDIA_T4_GPUS          spot: PREEMPTIBLE_NVIDIA_T4_GPUS
        nvidia-tesla-v100     NVIDIA_V100_GPUS        spot: PREEMPTIBLE_NVIDIA_V100_GPUS
        nvidia-tesla-a100     NVIDIA_A100_GPUS        spot: PREEMPTIBLE_NVIDIA_A100_GPUS
        nvidia-a100-80gb      NVIDIA_A100_80GB_GPUS   spot: PREEMPTIBLE_NVIDIA_A100_80GB_GPUS
        nvidia-l4             NVIDIA_L4_GPUS          spot: PREEMPTIBLE_NVIDIA_L4_GPUS
        nvidia-h100-80gb      NVIDIA_H100_GPUS        spot: PREEMPTIBLE_NVIDIA_H100_GPUS
        (full table: :data:`GCE_GPU_QUOTA_METRICS`)

    :meth:`GcpCompute.preflight` reads the region (``req.region``, else the zone less its last
    ``-x`` part) with ``RegionsClient.get`` (one ``GET .../regions/{region}`` per call, no cache:
    usage changes) and raises :class:`QuotaExceeded` (``code = "QUOTA_EXCEEDED"``, the code GCE's
    own insert operation reports; ``option = req.offer_id``; attributes ``metric``, ``region``,
    ``quota``, ``in_use``, ``needed``) when ``limit - usage < req.gpu_count``. ``usage`` is the whole
    project's, not only ours. Spot (``market == "spot"``) checks ``PREEMPTIBLE_<metric>`` when the
    region grants it (listed with ``limit > 0``), independently of the on-demand metric; without
    preemptible quota GCE charges Spot VMs to the standard quota (Spot VMs docs: "To prevent Spot VMs
    from consuming your quotas for standard VMs' CPUs, GPUs, and disks, consider requesting
    preemptible quota"), so then the standard metric is checked.

    Advisory, never blocking on doubt: no GPUs, a GPU type without a metric, or a metric the region
    does not list -> no check (returns). A failed ``regions.get`` (HTTP error, network, no
    credentials) raises a plain :class:`ProviderError` (``code = "QuotaPreflightFailed"``, never a
    subclass: a 403 "Read requests quota exceeded" must not look like a GPU quota error), which
    :func:`providers.provisioner.provision_with_failover` logs and ignores before going on to the
    create call (which still classifies GCE's own ``QUOTA_EXCEEDED``).
    Not checked: the project-wide ``GPUS_ALL_REGIONS`` (on the Project resource, not the Region) and
    the regional vCPU metrics (``CPUS``, ``A2_CPUS``, ...).

    Quota scope. :class:`GcpCompute` has no ``quota_family``: the provisioner's default scope family,
    the option's ``gpu_type``, is the right one for GCE, whose GPU quota is per GPU model. A family
    derived from the instance type alone would be wrong: one ``n1-*`` type takes T4, V100, P100 or
    P4, each with its own quota, so a T4 quota error must not skip the V100 options of the same type.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from datetime import datetime
from typing import Any

import requests
from google.api_core import exceptions as gexc
from google.api_core import retry as gretry
from google.auth.credentials import AnonymousCredentials, Credentials
from google.cloud import compute_v1

from providers.base import (MANAGED_TAG, check_outputs, Compute, InstanceInfo, InstanceRequest, NoCapacity, ProviderError,
                            QuotaExceeded, SupportsQuotaPreflight, SupportsSweep, Throttled, Unsupported, as_uuid)

__all__ = ["GcpCompute", "instance_name", "label_key", "label_value", "gce_accelerator", "GCE_ACCELERATORS",
           "GCE_GPU_QUOTA_METRICS", "PREEMPTIBLE_PREFIX", "gpu_quota_metric", "zone_region", "DEFAULT_IMAGE",
           "map_state", "compute_from_settings", "offer_in_network", "settings_from_terraform", "TERRAFORM_OUTPUTS"]

log = logging.getLogger(__name__)

#: default boot image: a Deep Learning VM family with CUDA, NVIDIA driver (``install-nvidia-driver``) and Docker.
#: Configure per deployment (``image=`` or ``InstanceRequest.image``); families are renamed over time.
DEFAULT_IMAGE = "projects/deep-learning-platform-release/global/images/family/common-cu124-debian-11-py310"

#: canonical GPU type -> GCE accelerator type name
GCE_ACCELERATORS: dict[str, str] = {
    "T4": "nvidia-tesla-t4",
    "V100": "nvidia-tesla-v100",
    "P100": "nvidia-tesla-p100",
    "P4": "nvidia-tesla-p4",
    "A100": "nvidia-tesla-a100",
    "A100-40GB": "nvidia-tesla-a100",
    "A100-80GB": "nvidia-a100-80gb",
    "L4": "nvidia-l4",
    "H100": "nvidia-h100-80gb",
    "H100-80GB": "nvidia-h100-80gb",
    "H100-MEGA": "nvidia-h100-mega-80gb",
}
#: GCE accelerator type -> regional on-demand GPU quota metric (unit: GPUs; the spot metric is
#: ``PREEMPTIBLE_PREFIX + metric``). Source: Google Cloud docs, Compute Engine "GPU quota" and "Allocation
#: quotas" (metric names as ``regions.get`` lists them in ``Region.quotas[].metric``); all but the H100 ones are
#: also in ``compute_v1.Quota.Metric`` (google-cloud-compute 1.57, whose enum lags the API; the field is a string).
#: A type not listed here (or a metric a region does not list) is not checked.
GCE_GPU_QUOTA_METRICS: dict[str, str] = {
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-tesla-t4-vws": "NVIDIA_T4_VWS_GPUS",
    "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
    "nvidia-tesla-p100": "NVIDIA_P100_GPUS",
    "nvidia-tesla-p100-vws": "NVIDIA_P100_VWS_GPUS",
    "nvidia-tesla-p4": "NVIDIA_P4_GPUS",
    "nvidia-tesla-p4-vws": "NVIDIA_P4_VWS_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    "nvidia-h100-mega-80gb": "NVIDIA_H100_MEGA_GPUS",
}
#: prefix of the spot (preemptible) variant of a GPU quota metric
PREEMPTIBLE_PREFIX = "PREEMPTIBLE_"
#: machine families whose GPUs come with the machine type (no guestAccelerators)
BUILTIN_GPU_FAMILIES = ("a2", "a3", "a4", "g2")
#: GPUs that can be attached to n1 machine types
N1_ATTACHABLE = {"nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-p4"}

_STATES = {"PROVISIONING": "pending", "STAGING": "pending", "REPAIRING": "pending", "RUNNING": "running",
           "STOPPING": "stopping", "SUSPENDING": "stopping", "TERMINATED": "stopped", "STOPPED": "stopped",
           "SUSPENDED": "stopped"}

CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"}
QUOTA_CODES = {"QUOTA_EXCEEDED", "quotaExceeded"}
THROTTLE_CODES = {"rateLimitExceeded", "userRateLimitExceeded", "RESOURCE_OPERATION_RATE_EXCEEDED",
                  "RATE_LIMIT_EXCEEDED"}
UNSUPPORTED_CODES = {"UNSUPPORTED_OPERATION", "RESOURCE_NOT_FOUND", "INVALID_FIELD_VALUE", "invalid",
                     "invalidParameter"}
EXISTS_CODES = {"RESOURCE_ALREADY_EXISTS", "alreadyExists"}
TAGS_METADATA_KEY = "fedbroker-tags"
PREEMPTED_OP = "compute.instances.preempted"


def instance_name(token: str) -> str:
    """GCE instance name of a request: ``fb-`` + 20 lowercase hex digits of the token (a non-hex token
    is hashed first). Matches ``[a-z]([-a-z0-9]*[a-z0-9])?``, 23 characters (limit 63)."""
    t = token.lower()
    if not re.fullmatch(r"[0-9a-f]{20,}", t):
        t = hashlib.sha256(token.encode()).hexdigest()
    return "fb-" + t[:20]


def label_key(key: str) -> str:
    """A GCE label key for a tag key: lower case, ``[a-z0-9_-]``, starts with a letter, at most 63 characters."""
    k = re.sub(r"[^a-z0-9_-]", "_", key.lower())
    if not k or not k[0].isalpha():
        k = "k" + k
    return k[:63]


def label_value(value: str) -> str:
    """A GCE label value for a tag value: lower case, ``[a-z0-9_-]``, at most 63 characters (lossy:
    the exact tags are kept in the instance metadata too)."""
    return re.sub(r"[^a-z0-9_-]", "_", str(value).lower())[:63]


def gce_accelerator(gpu_type: str) -> str:
    """Canonical GPU type (``T4``) -> GCE accelerator type (``nvidia-tesla-t4``); a name already in GCE
    form passes through. ``Unsupported`` for an unknown type."""
    if gpu_type.lower().startswith("nvidia-"):
        return gpu_type.lower()
    try:
        return GCE_ACCELERATORS[gpu_type.upper()]
    except KeyError:
        raise Unsupported(f"GPU type {gpu_type!r} has no GCE accelerator mapping", code="UnknownGpuType") from None


def gpu_quota_metric(gpu_type: str, market: str = "on_demand") -> str | None:
    """Regional GCE quota metric (unit: GPUs) a request for ``gpu_type`` GPUs counts against:
    ``("T4", "on_demand") -> "NVIDIA_T4_GPUS"``, ``("T4", "spot") -> "PREEMPTIBLE_NVIDIA_T4_GPUS"``;
    ``None`` for a GPU type without a GCE accelerator or metric (see :data:`GCE_GPU_QUOTA_METRICS`).
    For spot this is the preemptible metric; :meth:`GcpCompute.preflight` falls back to the standard one
    where the region grants no preemptible quota."""
    try:
        base = GCE_GPU_QUOTA_METRICS.get(gce_accelerator(gpu_type))
    except Unsupported:
        return None
    if base is None:
        return None
    return PREEMPTIBLE_PREFIX + base if market == "spot" else base


def zone_region(zone: str) -> str:
    """Region of a GCE zone: the zone less its last ``-x`` part (``us-central1-a -> us-central1``)."""
    return zone.rsplit("-", 1)[0] if "-" in zone else zone


def map_state(status: str) -> str:
    """GCE instance status -> the normalised :class:`providers.base.InstanceInfo` state (``unknown`` if unlisted)."""
    return _STATES.get(status or "", "unknown")


def _last(url: str) -> str:
    return (url or "").rstrip("/").rsplit("/", 1)[-1]


def _parse_ts(ts: str) -> datetime | None:
    if not ts:
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return None


def machine_type_of(instance_type: str) -> str:
    """The GCE machine type of a catalog instance type.

    The bundled catalog names an n1 host with attached GPUs ``"<host>+<GPU>x<count>"``
    (``pricing/catalog.py``), e.g. ``n1-highmem-8+T4x1`` -> ``n1-highmem-8``; the GPUs go in
    ``guestAccelerators``. Any other name (``a2-highgpu-1g``, ``n1-standard-8``) is returned as is.
    """
    return instance_type.split("+", 1)[0]


class GcpCompute(Compute, SupportsQuotaPreflight, SupportsSweep):
    """Compute Engine adapter. Clients default to the REST transport of ``google-cloud-compute``
    (``api_endpoint`` for a fake/emulator, ``credentials`` else Application Default Credentials).
    ``image``/``network``/``subnetwork``/``service_account`` shape every instance; ``op_timeout_s``
    bounds the wait for an insert operation (seconds). ``regions_client`` (``compute_v1.RegionsClient``,
    for :meth:`preflight`) is made on first use with the same ``api_endpoint``/``credentials`` when not
    given; pass one whenever ``instances_client`` is injected, since an injected client's endpoint is
    not copied. ``preflight_timeout_s`` bounds that read (seconds, retries included; the client's own
    default would retry a 503 for up to 600 s)."""

    name = "gcp"

    def __init__(self, project: str, instances_client: compute_v1.InstancesClient | None = None,
                 zone_operations_client: compute_v1.ZoneOperationsClient | None = None,
                 api_endpoint: str | None = None, credentials: Credentials | None = None,
                 image: str = DEFAULT_IMAGE, network: str = "global/networks/default",
                 subnetwork: str | None = None, service_account: str | None = None,
                 op_timeout_s: float = 120.0, *, boot_disk_gb: int = 200, boot_disk_type: str = "pd-balanced",
                 external_ip: bool = False, poll_interval_s: float = 1.0, broker_label_filter: bool = True,
                 network_tags: tuple[str, ...] = ("fedbroker-node",),
                 regions_client: compute_v1.RegionsClient | None = None, preflight_timeout_s: float = 10.0):
        self.project = project
        opts = {"api_endpoint": api_endpoint} if api_endpoint else None
        self._client_options = opts
        self._credentials = credentials
        self._instances = instances_client or compute_v1.InstancesClient(
            transport="rest", client_options=opts, credentials=credentials)
        self._ops = zone_operations_client or compute_v1.ZoneOperationsClient(
            transport="rest", client_options=opts, credentials=credentials)
        # made lazily: building a client resolves credentials, and the preflight is advisory
        self._regions: compute_v1.RegionsClient | None = regions_client
        #: seconds one preflight may spend on regions.get, retries of 503/deadline errors included
        self.preflight_timeout_s = preflight_timeout_s
        self.image = image
        self.network = network
        self.subnetwork = subnetwork
        self.service_account = service_account
        self.op_timeout_s = op_timeout_s
        self.boot_disk_gb = boot_disk_gb
        self.boot_disk_type = boot_disk_type
        self.external_ip = external_ip
        #: network tags of every instance: terraform/gcp's NCCL firewall rule matches "fedbroker-node"
        self.network_tags = tuple(network_tags)
        self.poll_interval_s = poll_interval_s
        self.broker_label_filter = broker_label_filter

    @classmethod
    def for_endpoint(cls, project: str, api_endpoint: str, **kw: Any) -> "GcpCompute":
        """An adapter talking to ``api_endpoint`` (a fake or emulator) with anonymous credentials."""
        return cls(project, api_endpoint=api_endpoint, credentials=AnonymousCredentials(), **kw)

    # ---- request building ---------------------------------------------------------------------

    def _accelerators(self, req: InstanceRequest) -> list[compute_v1.AcceleratorConfig]:
        family = req.instance_type.split("-", 1)[0].lower()
        if req.gpu_count <= 0 or family in BUILTIN_GPU_FAMILIES:
            return []
        acc = gce_accelerator(req.gpu_type)
        if family != "n1" or acc not in N1_ATTACHABLE:
            raise Unsupported(f"{req.gpu_type} ({acc}) cannot be attached to {req.instance_type}",
                              option=req.offer_id, code="UnsupportedAccelerator")
        return [compute_v1.AcceleratorConfig(accelerator_type=f"zones/{req.zone}/acceleratorTypes/{acc}",
                                             accelerator_count=req.gpu_count)]

    def instance_resource(self, req: InstanceRequest) -> compute_v1.Instance:
        """The ``Instance`` body the insert sends for ``req``."""
        accels = self._accelerators(req)
        spot = req.market == "spot"
        sched = compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=not spot)
        if spot:
            sched.provisioning_model = "SPOT"
            sched.instance_termination_action = "DELETE"
        else:
            sched.provisioning_model = "STANDARD"
        nic = compute_v1.NetworkInterface(network=self.network)
        if self.subnetwork:
            nic.subnetwork = self.subnetwork
        if self.external_ip:
            nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        disk = compute_v1.AttachedDisk(
            boot=True, auto_delete=True, type_="PERSISTENT",
            initialize_params=compute_v1.AttachedDiskInitializeParams(
                source_image=req.image or self.image, disk_size_gb=self.boot_disk_gb,
                disk_type=f"zones/{req.zone}/diskTypes/{self.boot_disk_type}"))
        items = [compute_v1.Items(key="startup-script", value=req.user_data),
                 compute_v1.Items(key="install-nvidia-driver", value="True"),
                 compute_v1.Items(key=TAGS_METADATA_KEY, value=json.dumps(req.tags, sort_keys=True))]
        inst = compute_v1.Instance(
            name=instance_name(req.token),
            machine_type=f"zones/{req.zone}/machineTypes/{machine_type_of(req.instance_type)}",
            labels={label_key(k): label_value(v) for k, v in req.tags.items()},
            metadata=compute_v1.Metadata(items=items),
            scheduling=sched, disks=[disk], network_interfaces=[nic], guest_accelerators=accels)
        if self.network_tags:
            inst.tags = compute_v1.Tags(items=list(self.network_tags))
        if self.service_account:
            inst.service_accounts = [compute_v1.ServiceAccount(
                email=self.service_account, scopes=["https://www.googleapis.com/auth/cloud-platform"])]
        return inst

    # ---- Compute ------------------------------------------------------------------------------

    def launch(self, req: InstanceRequest) -> InstanceInfo:
        name = instance_name(req.token)
        body = self.instance_resource(req)
        deadline = time.monotonic() + self.op_timeout_s
        try:
            op = self._instances.insert_unary(request=compute_v1.InsertInstanceRequest(
                project=self.project, zone=req.zone, instance_resource=body, request_id=as_uuid(req.token)))
        except gexc.GoogleAPICallError as e:
            if _http_code(e) in EXISTS_CODES or isinstance(e, gexc.Conflict):
                return self.describe(name, req.zone)
            raise self._map_http(e, req.offer_id) from e
        except requests.exceptions.RequestException as e:
            raise ProviderError(f"GCE insert {name} in {req.zone}: {e}", option=req.offer_id,
                                code=type(e).__name__) from e
        done = self._wait(op, req.zone, deadline)
        if done is None:  # timed out: not a failure; reconcile by name
            try:
                return self.describe(name, req.zone)
            except ProviderError as e:
                if e.code != "NotFound":
                    raise
                raise ProviderError(f"GCE insert {name} in {req.zone}: operation {op.name} not done after "
                                    f"{self.op_timeout_s}s and no instance yet", option=req.offer_id,
                                    code="OperationTimeout") from None
        codes = [err.code for err in done.error.errors] if done.error else []
        if codes:
            if set(codes) & EXISTS_CODES:
                return self.describe(name, req.zone)
            raise self._map_op_error(done, req.offer_id)
        return self.describe(name, req.zone)

    def describe(self, instance_id: str, zone: str) -> InstanceInfo:
        try:
            inst = self._instances.get(project=self.project, zone=zone, instance=instance_id)
        except gexc.NotFound as e:
            raise ProviderError(f"GCE instance {instance_id} in {zone} not found", code="NotFound") from e
        except gexc.GoogleAPICallError as e:
            raise self._map_http(e, None) from e
        return self._info(inst)

    def terminate(self, instance_id: str, zone: str) -> None:
        """Delete the VM (boot disk auto-deletes). Does not wait for the delete operation (a GPU VM takes
        up to a minute or two to go); an unknown or already deleted VM is fine."""
        try:
            op = self._instances.delete_unary(project=self.project, zone=zone, instance=instance_id)
        except gexc.NotFound:
            return
        except gexc.GoogleAPICallError as e:
            raise self._map_http(e, None) from e
        if op.status == compute_v1.Operation.Status.DONE and op.error and op.error.errors:
            codes = {err.code for err in op.error.errors}
            if codes & {"RESOURCE_NOT_FOUND"}:
                return
            raise self._map_op_error(op, None)

    def list_managed(self, broker_id: str) -> list[InstanceInfo]:
        """Instances labelled ``MANAGED_TAG = broker_id`` in every zone (aggregated list, server-side label
        filter, then an exact check on the original tags); includes stopped (TERMINATED) ones."""
        flt = f'labels.{label_key(MANAGED_TAG)} = "{label_value(broker_id)}"' if self.broker_label_filter else None
        req = compute_v1.AggregatedListInstancesRequest(project=self.project)
        if flt:
            req.filter = flt
        try:
            pager = self._instances.aggregated_list(request=req)
            out = []
            for _scope, scoped in pager:
                for inst in scoped.instances:
                    info = self._info(inst)
                    if info.tags.get(MANAGED_TAG) == broker_id:
                        out.append(info)
        except gexc.GoogleAPICallError as e:
            raise self._map_http(e, None) from e
        return sorted(out, key=lambda i: (i.zone, i.instance_id))

    # ---- quota preflight ----------------------------------------------------------------------

    def preflight(self, req: InstanceRequest) -> None:
        """Raise :class:`QuotaExceeded` if the region's GPU quota cannot hold ``req.gpu_count`` more GPUs.

        Metric: :func:`gpu_quota_metric` of ``req.gpu_type`` (spot: the ``PREEMPTIBLE_`` one where the
        region lists it with a limit > 0, else the standard one, which GCE then charges). Blocks only when
        the region lists the metric and ``limit - usage < req.gpu_count`` (all in GPUs); the error has
        ``code = "QUOTA_EXCEEDED"``, ``option = req.offer_id`` and attributes ``metric``, ``region``,
        ``quota`` (limit), ``in_use`` (usage), ``needed``. No GPUs, no known metric or a metric the region
        does not list -> returns. A failed ``regions.get`` -> plain :class:`ProviderError`
        (``code = "QuotaPreflightFailed"``), which the provisioner treats as advisory.
        """
        if req.gpu_count <= 0:
            return
        base = gpu_quota_metric(req.gpu_type, "on_demand")
        if base is None:
            return
        region = req.region or zone_region(req.zone)
        quotas = self.region_quotas(region, option=req.offer_id)
        metric = base
        if req.market == "spot":
            pre = PREEMPTIBLE_PREFIX + base
            if quotas.get(pre, (0.0, 0.0))[0] > 0:
                metric = pre
            # else: no preemptible quota granted in the region -> Spot VMs consume the standard quota
        if metric not in quotas:
            log.info("gcp preflight for %s: %s not listed in %s, not checked", req.offer_id, metric, region)
            return
        limit, usage = quotas[metric]
        if limit - usage < req.gpu_count:
            market = "spot" if req.market == "spot" else "on_demand"
            err = QuotaExceeded(
                f"GCE quota {metric} in region {region}: limit {limit:g}, usage {usage:g}, requested "
                f"{req.gpu_count} more ({req.gpu_type} GPUs, {market}, {req.instance_type})",
                option=req.offer_id, code="QUOTA_EXCEEDED")
            err.metric, err.region = metric, region  # type: ignore[attr-defined]
            err.quota, err.in_use, err.needed = limit, usage, req.gpu_count  # type: ignore[attr-defined]
            raise err

    def region_quotas(self, region: str, option: str | None = None) -> dict[str, tuple[float, float]]:
        """``metric -> (limit, usage)`` of ``region`` from ``regions.get`` (``Region.quotas``; GPU metrics
        are in GPUs). 503 and deadline errors are retried for at most ``preflight_timeout_s`` seconds. Any
        failure (HTTP error, network, credentials) -> plain :class:`ProviderError` with
        ``code = "QuotaPreflightFailed"``."""
        try:
            if self._regions is None:
                self._regions = compute_v1.RegionsClient(
                    transport="rest", client_options=self._client_options, credentials=self._credentials)
            reg = self._regions.get(
                project=self.project, region=region, timeout=self.preflight_timeout_s,
                retry=gretry.Retry(predicate=gretry.if_exception_type(gexc.ServiceUnavailable, gexc.DeadlineExceeded),
                                   initial=0.1, maximum=1.0, multiplier=2.0, deadline=self.preflight_timeout_s))
        except Exception as e:  # noqa: BLE001 - advisory: never let a read failure look like a quota verdict
            raise ProviderError(f"GCE quota preflight: regions.get {region} failed: {type(e).__name__}: {e}",
                                option=option, code="QuotaPreflightFailed") from e
        return {q.metric: (float(q.limit), float(q.usage)) for q in reg.quotas if q.metric}

    # ---- preemption ---------------------------------------------------------------------------

    def preempted(self, instance_id: str, zone: str) -> bool:
        """Whether GCE preempted this VM: the zone's operation list holds a ``compute.instances.preempted``
        operation targeting it (GCE keeps operations for a limited time). A VM that is up now
        (pending/running) is not preempted, without listing."""
        try:
            inst = self._instances.get(project=self.project, zone=zone, instance=instance_id)
            if map_state(inst.status) in ("pending", "running"):
                return False
        except gexc.NotFound:
            pass
        except gexc.GoogleAPICallError as e:
            raise self._map_http(e, None) from e
        try:
            ops = self._ops.list(request=compute_v1.ListZoneOperationsRequest(
                project=self.project, zone=zone, filter=f'operationType = "{PREEMPTED_OP}"'))
            return any(_last(op.target_link) == instance_id for op in ops)
        except gexc.GoogleAPICallError as e:
            raise self._map_http(e, None) from e

    def was_preempted(self, info: InstanceInfo) -> bool:
        """``preempted`` for an instance we knew (only spot VMs can be preempted)."""
        return bool(info.spot) and self.preempted(info.instance_id, info.zone)

    # ---- internals ----------------------------------------------------------------------------

    def _wait(self, op: compute_v1.Operation, zone: str, deadline: float) -> compute_v1.Operation | None:
        """The operation once DONE, or None when ``deadline`` passes first."""
        while op.status != compute_v1.Operation.Status.DONE:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                op = self._ops.wait(project=self.project, zone=zone, operation=op.name,
                                    timeout=max(remaining, 0.05))
            except (gexc.DeadlineExceeded, gexc.ServiceUnavailable, gexc.TooManyRequests,
                    requests.exceptions.RequestException):
                pass  # not known yet; keep trying until the deadline, then reconcile by name
            except gexc.NotFound:
                return None  # the operation is gone (GCE keeps them a limited time): reconcile by name
            if op.status != compute_v1.Operation.Status.DONE:
                time.sleep(max(0.0, min(self.poll_interval_s, deadline - time.monotonic())))
        return op

    def _info(self, inst: compute_v1.Instance) -> InstanceInfo:
        tags = dict(inst.labels)
        for item in inst.metadata.items if inst.metadata else []:
            if item.key == TAGS_METADATA_KEY:
                try:
                    tags = {str(k): str(v) for k, v in json.loads(item.value).items()}
                except (ValueError, AttributeError):
                    pass
        ip = inst.network_interfaces[0].network_i_p if inst.network_interfaces else ""
        sched = inst.scheduling
        spot = bool(sched and (sched.provisioning_model == "SPOT" or sched.preemptible))
        return InstanceInfo(provider="gcp", instance_id=inst.name, zone=_last(inst.zone),
                            instance_type=_last(inst.machine_type), state=map_state(inst.status),
                            private_ip=ip or None, tags=tags, launched_at=_parse_ts(inst.creation_timestamp),
                            spot=spot)

    def _map_op_error(self, op: compute_v1.Operation, option: str | None) -> ProviderError:
        errs = list(op.error.errors)
        codes = [e.code for e in errs]
        msg = "; ".join(f"{e.code}: {e.message}" for e in errs)
        status = op.http_error_status_code or 0
        return _classify(codes, status, msg, option)

    def _map_http(self, e: gexc.GoogleAPICallError, option: str | None) -> ProviderError:
        status = int(e.code or 0) if isinstance(e.code, int) else 0
        reasons = [r for r in ([d.get("reason") for d in e.errors if isinstance(d, dict)] + [e.reason]) if r]
        err = _classify(reasons, status, e.message or str(e), option)
        if isinstance(err, Throttled) and e.response is not None:
            try:
                ra = getattr(e.response, "headers", {}).get("Retry-After")
                err.retry_after_s = float(ra) if ra is not None else None
            except (TypeError, ValueError):
                pass
        return err


def _http_code(e: gexc.GoogleAPICallError) -> str | None:
    for d in e.errors:
        if isinstance(d, dict) and d.get("reason"):
            return d["reason"]
    return e.reason


def _classify(codes: list[str], http_status: int, message: str, option: str | None) -> ProviderError:
    """One provider error from GCE error codes/reasons, HTTP status and message (see the module doc)."""
    code = codes[0] if codes else (f"HTTP {http_status}" if http_status else None)
    low = message.lower()

    def pick(wanted: set[str]) -> str | None:
        return next((c for c in codes if c in wanted), None)

    if http_status == 429 or pick(THROTTLE_CODES):
        return Throttled(message, option=option, code=pick(THROTTLE_CODES) or code)
    if pick(QUOTA_CODES) or (http_status == 403 and "quota" in low and "exceeded" in low):
        return QuotaExceeded(message, option=option, code=pick(QUOTA_CODES) or code)
    if pick(CAPACITY_CODES) or "does not have enough resources available" in low:
        return NoCapacity(message, option=option, code=pick(CAPACITY_CODES) or code)
    if pick(UNSUPPORTED_CODES) or http_status in (400, 404):
        return Unsupported(message, option=option, code=pick(UNSUPPORTED_CODES) or code)
    return ProviderError(message, option=option, code=code)


# ---------------------------------------------------------------------- registry functions (providers.registry)
#: terraform output name -> settings key (terraform/gcp/outputs.tf)
TERRAFORM_OUTPUTS = {"project": "project", "region": "region", "network": "network", "subnetwork": "subnetwork",
                     "service_account_email": "service_account_email", "gpu_image": "gpu_image",
                     "instance_template": "instance_template"}


def compute_from_settings(section: Any) -> GcpCompute:
    """The adapter for the broker's ``gcp`` settings section (``project``, ``gpu_image``, ``network``,
    ``subnetwork``, ``service_account_email``, ``operation_timeout_s``; ``api_endpoint`` set: a fake or
    emulator, through :meth:`GcpCompute.for_endpoint`)."""
    kw = dict(image=section.gpu_image, network=section.network, subnetwork=section.subnetwork,
              service_account=section.service_account_email, op_timeout_s=section.operation_timeout_s)
    if section.api_endpoint:
        return GcpCompute.for_endpoint(section.project, section.api_endpoint, **kw)
    return GcpCompute(section.project, **kw)


def offer_in_network(section: Any, offer: Any) -> bool:
    """Whether ``offer`` is in the ``gcp`` settings section's region (its subnetwork is regional)."""
    return offer.region == section.region


def settings_from_terraform(files: list[tuple[Any, dict]]) -> dict:
    """The ``gcp`` settings section for ``[(path, outputs)]``: exactly one ``terraform output -json`` of
    ``terraform/gcp``. Raises ``ValueError`` naming the file and the missing or null output."""
    if len(files) != 1:
        raise ValueError(f"gcp: give exactly one outputs file, got {len(files)}")
    f, out = files[0]
    check_outputs(f, out, ("project", "region"), ("project", "region"), "terraform/gcp")
    return {key: out[name] for name, key in TERRAFORM_OUTPUTS.items() if out.get(name) is not None}
