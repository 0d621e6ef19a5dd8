"""A local fake of the Compute Engine ``compute/v1`` REST API, for the GCP adapter's tests.

It serves, on ``http://127.0.0.1:<port>`` (stdlib ``ThreadingHTTPServer`` in a thread), just what
``providers.gcp.GcpCompute`` calls through the real ``google-cloud-compute`` REST transport::

    POST   /compute/v1/projects/{p}/zones/{z}/instances              insert (honours ?requestId=)
    GET    /compute/v1/projects/{p}/zones/{z}/instances              list   (?filter=)
    GET    /compute/v1/projects/{p}/zones/{z}/instances/{name}       get
    DELETE /compute/v1/projects/{p}/zones/{z}/instances/{name}       delete (?requestId=)
    GET    /compute/v1/projects/{p}/aggregated/instances             aggregatedList (?filter=)
    GET    /compute/v1/projects/{p}/zones/{z}/operations             list   (?filter=)
    GET    /compute/v1/projects/{p}/zones/{z}/operations/{op}        get
    POST   /compute/v1/projects/{p}/zones/{z}/operations/{op}/wait   wait (blocks up to ``wait_block_s``)
    GET    /compute/v1/projects/{p}/regions/{r}                      get (a Region with ``quotas``)

Behaviour modelled on GCE:

* ``insert`` answers HTTP 200 with an operation in status ``RUNNING``; the operation is ``DONE`` on
  the next read (``get``/``wait``). The instance resource exists from the insert on, in status
  ``PROVISIONING``, and becomes ``RUNNING`` when the operation completes (``auto_run``).
* The same ``requestId`` returns the same operation and creates nothing (GCE's request
  de-duplication). A second insert of an existing name with a new requestId ends in an operation
  error ``RESOURCE_ALREADY_EXISTS`` (real GCE answers HTTP 409 ``alreadyExists``; :meth:`forget_request_ids`
  + ``conflict_as_http=True`` gives that form).
* Capacity errors are *asynchronous*, as on GCE: HTTP 200 insert whose operation ends ``DONE`` with
  ``error.errors[0].code = ZONE_RESOURCE_POOL_EXHAUSTED`` (or ``..._WITH_DETAILS``) and
  ``httpErrorStatusCode 503``; the instance is not created.
* Quota: by default the operation form (``QUOTA_EXCEEDED``, ``httpErrorStatusCode 403``, with an
  ``errorDetails[].quotaInfo``); ``via="http"`` gives the synchronous HTTP 403 ``reason: quotaExceeded``.
* Rate limits: synchronous HTTP 429 (or 403) with ``reason: rateLimitExceeded`` and an optional
  ``Retry-After`` header.
* Unsupported: synchronous HTTP 400 ``reason: invalid`` ("Machine type ... does not exist in zone").
  Instances with guest accelerators must have ``scheduling.onHostMaintenance = TERMINATE`` (else
  HTTP 400, as on GCE).
* A hung operation stays ``RUNNING`` forever (the instance exists, ``PROVISIONING``, unless
  ``create_instance=False``).
* :meth:`preempt` does what GCE does to a spot VM: with ``instanceTerminationAction = DELETE`` the
  instance is deleted, with ``STOP`` it goes ``TERMINATED`` (``lastStopTimestamp`` set); either way a
  ``compute.instances.preempted`` operation is recorded in the zone's operation list.

* Regions: ``regions.get`` answers any region name with a ``compute#region`` resource whose
  ``quotas`` are ``[{metric, limit, usage}, ...]`` as set by :meth:`set_quota` (none by default: GCE
  lists every metric, but a test names the ones it means). ``usage`` is a plain settable number; it
  is not derived from the instances. :meth:`fail_next_region_get` answers the next get of a region
  with an HTTP error.

Filters (``filter=``) support conjunctions of ``FIELD = "VALUE"`` / ``FIELD != "VALUE"`` (also
``eq``/``ne``), joined by ``AND`` or by juxtaposed parenthesised terms; ``FIELD`` is a dotted camelCase
path (``labels.fedbroker-broker``, ``status``, ``operationType``). Anything else is HTTP 400.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
import zlib
from collections import defaultdict, deque
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

API = "https://www.googleapis.com/compute/v1"

_INSTANCE = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances(?:/([^/]+))?$")
_OPERATION = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/operations(?:/([^/]+?))?(/wait)?$")
_AGGREGATED = re.compile(r"^/compute/v1/projects/([^/]+)/aggregated/instances$")
_REGION = re.compile(r"^/compute/v1/projects/([^/]+)/regions/([^/]+)$")
_TERM = re.compile(r'\s*\(?\s*([A-Za-z0-9_.\-]+)\s*(=|!=|\beq\b|\bne\b)\s*("(?:[^"\\]|\\.)*"|[^\s)]+)\s*\)?\s*')


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class GceHttpError(Exception):
    def __init__(self, status: int, message: str, reason: str, domain: str = "global",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.domain = status, message, reason, domain
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message,
                          "errors": [{"message": self.message, "domain": self.domain, "reason": self.reason}]}}


def parse_filter(expr: str) -> list[tuple[str, str, str]]:
    """``labels.a = "b" AND (status != "TERMINATED")`` -> ``[(field, op, value), ...]``; ValueError if unsupported."""
    expr = (expr or "").strip()
    if not expr:
        return []
    terms, pos = [], 0
    while pos < len(expr):
        m = _TERM.match(expr, pos)
        if not m:
            raise ValueError(f"Invalid list filter expression: {expr!r}")
        field, op, value = m.group(1), m.group(2), m.group(3)
        if value.startswith('"'):
            value = json.loads(value)
        terms.append((field, "=" if op in ("=", "eq") else "!=", value))
        pos = m.end()
        a = re.match(r"\s*AND\s+", expr[pos:])
        if a:
            pos += a.end()
    return terms


def _lookup(resource: dict, path: str) -> Any:
    cur: Any = resource
    parts = path.split(".")
    # label keys may hold dots? (they cannot on GCE); take first part, then the rest as one key for labels
    if parts[0] in ("labels",) and len(parts) > 1:
        return (resource.get("labels") or {}).get(".".join(parts[1:]))
    for p in parts:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def matches(resource: dict, terms: list[tuple[str, str, str]]) -> bool:
    for field, op, value in terms:
        got = _lookup(resource, field)
        got = None if got is None else str(got)
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
    return True


class FakeGce:
    """In-memory Compute Engine. Use as a context manager or ``start()``/``stop()``; ``endpoint`` is the
    ``api_endpoint`` for the client. Fault injection: :meth:`fail_next_insert`, :meth:`hang_next_insert`."""

    def __init__(self, project: str = "test-project", wait_block_s: float = 0.2, auto_run: bool = True,
                 conflict_as_http: bool = True):
        self.project = project
        self.wait_block_s = wait_block_s
        self.auto_run = auto_run
        self.conflict_as_http = conflict_as_http
        self.instances: dict[tuple[str, str], dict] = {}
        self.operations: dict[str, dict] = {}
        self._op_zone: dict[str, str] = {}
        self._pending_create: dict[str, tuple[str, str]] = {}  # op name -> (zone, instance name) to run on DONE
        self._hung: set[str] = set()
        self.request_ids: dict[tuple[str, str], str] = {}
        self.faults: dict[str, deque] = defaultdict(deque)
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, query)
        self.insert_bodies: list[dict] = []
        self.quotas: dict[str, dict[str, dict]] = defaultdict(dict)  # region -> metric -> {metric, limit, usage}
        self.region_faults: dict[str, deque] = defaultdict(deque)  # region -> HTTP statuses for the next gets
        self._ids = itertools.count(1000000000000000000)
        self._ips = itertools.count(2)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "FakeGce":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls per request

            def log_message(self, *a):  # quiet
                pass

            def _serve(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, body, headers = fake.handle(method, self.path, raw)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    self.close_connection = True

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def do_DELETE(self):
                self._serve("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-gce", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeGce":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._server, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- fault injection and test helpers -----------------------------------------------------

    def fail_next_insert(self, zone: str, kind: str, **kw: Any) -> None:
        """Answer the next insert in ``zone`` with a fault. ``kind``:
        ``stockout`` (ZONE_RESOURCE_POOL_EXHAUSTED), ``stockout_details`` (..._WITH_DETAILS),
        ``quota`` (``metric="NVIDIA_T4_GPUS"``, ``via="operation"|"http"``),
        ``rate_limit`` (``status=429|403``, ``retry_after=None|seconds``),
        ``unsupported`` (HTTP 400 invalid machine type), ``hang`` (``create_instance=True``),
        ``op_error`` (``code=..., message=..., http_status=...``: any other operation error)."""
        assert kind in ("stockout", "stockout_details", "quota", "rate_limit", "unsupported", "hang", "op_error"), kind
        with self._lock:
            self.faults[zone].append((kind, kw))

    def hang_next_insert(self, zone: str, create_instance: bool = True) -> None:
        self.fail_next_insert(zone, "hang", create_instance=create_instance)

    def forget_request_ids(self) -> None:
        """GCE keeps a requestId only for a while; after that a retried insert is a new request."""
        with self._lock:
            self.request_ids.clear()

    def finish_hung_operations(self) -> None:
        with self._lock:
            for name in list(self._hung):
                self._hung.discard(name)
                self._complete(self.operations[name])

    def set_status(self, zone: str, name: str, status: str) -> None:
        with self._lock:
            self.instances[(zone, name)]["status"] = status

    def instance(self, zone: str, name: str) -> dict | None:
        with self._lock:
            inst = self.instances.get((zone, name))
            return copy.deepcopy(inst) if inst else None

    def instances_in(self, zone: str | None = None) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(v) for (z, _), v in sorted(self.instances.items()) if zone in (None, z)]

    def set_quota(self, region: str, metric: str, limit: float, usage: float = 0.0) -> None:
        """Set (or replace) quota ``metric`` of ``region`` as ``regions.get`` reports it (GPU metrics count
        GPUs; ``limit``/``usage`` are floats on the wire, as on GCE)."""
        with self._lock:
            self.quotas[region][metric] = {"metric": metric, "limit": float(limit), "usage": float(usage)}

    def set_usage(self, region: str, metric: str, usage: float) -> None:
        """Change only the usage of a quota set before."""
        with self._lock:
            self.quotas[region][metric]["usage"] = float(usage)

    def fail_next_region_get(self, region: str, status: int = 503, times: int = 1) -> None:
        """Answer the next ``times`` ``regions.get`` of ``region`` with HTTP ``status`` (503 ``backendError``,
        which the client retries; 403 ``rateLimitExceeded`` "Quota exceeded for quota metric 'Read
        requests'"; else reason ``error``)."""
        with self._lock:
            self.region_faults[region].extend([status] * times)

    def count(self, method: str, path_part: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and path_part in p)

    def preempt(self, zone: str, name: str) -> None:
        """Preempt a spot VM as GCE does (see module doc)."""
        with self._lock:
            inst = self.instances[(zone, name)]
            sched = inst.get("scheduling", {})
            assert sched.get("provisioningModel") == "SPOT" or sched.get("preemptible"), "not a spot VM"
            now = _now()
            op = self._new_op(zone, name, inst["id"], "compute.instances.preempted", user="system")
            op.update(status="DONE", progress=100, endTime=now,
                      statusMessage=f"Instance was preempted.")
            if sched.get("instanceTerminationAction") == "DELETE":
                del self.instances[(zone, name)]
            else:
                inst.update(status="TERMINATED", lastStopTimestamp=now)
            self._changed.notify_all()

    # ---- request handling ---------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, raw_body: bytes) -> tuple[int, dict, dict]:
        url = urlsplit(raw_path)
        path = url.path
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        with self._lock:
            self.requests.append((method, path, query))
        try:
            body = json.loads(raw_body) if raw_body else {}
            m = _INSTANCE.match(path)
            if m:
                project, zone, name = m.groups()
                self._check_project(project)
                if method == "POST" and not name:
                    return 200, self._insert(zone, body, query.get("requestId")), {}
                if method == "GET" and not name:
                    return 200, self._list(zone, query.get("filter", "")), {}
                if method == "GET":
                    return 200, self._get(zone, name), {}
                if method == "DELETE":
                    return 200, self._delete(zone, name, query.get("requestId")), {}
            m = _OPERATION.match(path)
            if m:
                project, zone, op, wait = m.groups()
                self._check_project(project)
                if method == "GET" and not op:
                    return 200, self._list_ops(zone, query.get("filter", "")), {}
                if method == "GET" and not wait:
                    return 200, self._get_op(zone, op, block=False), {}
                if method == "POST" and wait:
                    return 200, self._get_op(zone, op, block=True), {}
            m = _AGGREGATED.match(path)
            if m and method == "GET":
                self._check_project(m.group(1))
                return 200, self._aggregated(query.get("filter", "")), {}
            m = _REGION.match(path)
            if m and method == "GET":
                self._check_project(m.group(1))
                return 200, self._get_region(m.group(2)), {}
            raise GceHttpError(404, f"The requested URL {path} was not found on this server.", "notFound")
        except GceHttpError as e:
            return e.status, e.body(), e.headers
        except ValueError as e:
            return 400, GceHttpError(400, str(e), "invalid").body(), {}

    def _check_project(self, project: str) -> None:
        if project != self.project:
            raise GceHttpError(404, f"The resource 'projects/{project}' was not found", "notFound")

    # ---- instances ----------------------------------------------------------------------------

    def _zone_url(self, zone: str) -> str:
        return f"{API}/projects/{self.project}/zones/{zone}"

    def _new_op(self, zone: str, target: str, target_id: str, op_type: str, user: str = "test@example.com") -> dict:
        name = f"operation-{uuid.uuid4().hex[:13]}-{uuid.uuid4().hex[:8]}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name, "zone": self._zone_url(zone),
              "operationType": op_type, "targetLink": f"{self._zone_url(zone)}/instances/{target}",
              "targetId": target_id, "status": "RUNNING", "user": user, "progress": 0,
              "insertTime": _now(), "startTime": _now(),
              "selfLink": f"{self._zone_url(zone)}/operations/{name}"}
        self.operations[name] = op
        self._op_zone[name] = zone
        return op

    def _fail_op(self, op: dict, code: str, message: str, http_status: int, http_message: str,
                 details: list | None = None) -> dict:
        err: dict[str, Any] = {"code": code, "message": message}
        if details:
            err["errorDetails"] = details
        op["error"] = {"errors": [err]}
        op["httpErrorStatusCode"] = http_status
        op["httpErrorMessage"] = http_message
        return op

    def _insert(self, zone: str, body: dict, request_id: str | None) -> dict:
        with self._lock:
            if request_id and (zone, request_id) in self.request_ids:
                return copy.deepcopy(self.operations[self.request_ids[(zone, request_id)]])
            self.insert_bodies.append(copy.deepcopy(body))
            name = body.get("name") or ""
            if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
                raise GceHttpError(400, f"Invalid value for field 'resource.name': '{name}'. Must be a match of "
                                        "regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'", "invalid")
            mt = (body.get("machineType") or "").rsplit("/", 1)[-1]
            fault = self.faults[zone].popleft() if self.faults[zone] else None
            kind, kw = fault if fault else (None, {})
            if kind == "rate_limit":
                hdr = {"Retry-After": str(kw["retry_after"])} if kw.get("retry_after") is not None else {}
                raise GceHttpError(kw.get("status", 429), "Rate Limit Exceeded", "rateLimitExceeded",
                                   "usageLimits", hdr)
            if kind == "unsupported":
                raise GceHttpError(400, f"Invalid value for field 'resource.machineType': "
                                        f"'zones/{zone}/machineTypes/{mt}'. Machine type with name '{mt}' "
                                        f"does not exist in zone '{zone}'.", "invalid")
            if kind == "quota" and kw.get("via") == "http":
                metric = kw.get("metric", "NVIDIA_T4_GPUS")
                raise GceHttpError(403, f"Quota '{metric}' exceeded.  Limit: 0.0 in region {zone.rsplit('-', 1)[0]}.",
                                   "quotaExceeded", "usageLimits")
            if body.get("guestAccelerators") and (body.get("scheduling") or {}).get("onHostMaintenance") != "TERMINATE":
                raise GceHttpError(400, "Instances with guest accelerators do not support live migration.", "badRequest")
            if (zone, name) in self.instances and self.conflict_as_http and kind is None:
                raise GceHttpError(409, f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                                        "already exists", "alreadyExists")
            op = self._new_op(zone, name, str(next(self._ids)), "insert")
            if request_id:
                self.request_ids[(zone, request_id)] = op["name"]
            if kind in ("stockout", "stockout_details"):
                if kind == "stockout":
                    self._fail_op(op, "ZONE_RESOURCE_POOL_EXHAUSTED",
                                  f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                                  "available to fulfill the request.  Try a different zone, or try again later.",
                                  503, "SERVICE UNAVAILABLE")
                else:
                    self._fail_op(op, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                                  f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources "
                                  "available to fulfill the request.  '(resource type:compute)'.",
                                  503, "SERVICE UNAVAILABLE",
                                  [{"help": {"links": [{"description": "Troubleshooting documentation",
                                                        "url": "https://cloud.google.com/compute/docs/"
                                                               "resource-error"}]}}])
                op["_final"] = True
                return copy.deepcopy(self._public(op))
            if kind == "quota":
                metric = kw.get("metric", "NVIDIA_T4_GPUS")
                region = zone.rsplit("-", 1)[0]
                self._fail_op(op, "QUOTA_EXCEEDED", f"Quota '{metric}' exceeded.  Limit: 0.0 in region {region}.",
                              403, "FORBIDDEN",
                              [{"quotaInfo": {"metricName": f"compute.googleapis.com/{metric.lower()}",
                                              "limitName": f"{metric}-per-project-region",
                                              "dimensions": {"region": region}, "limit": 0}}])
                op["_final"] = True
                return copy.deepcopy(self._public(op))
            if kind == "op_error":
                self._fail_op(op, kw["code"], kw.get("message", kw["code"]), kw.get("http_status", 400),
                              kw.get("http_message", "BAD REQUEST"))
                op["_final"] = True
                return copy.deepcopy(self._public(op))
            if (zone, name) in self.instances:  # new request id, existing name: operation error
                self._fail_op(op, "RESOURCE_ALREADY_EXISTS",
                              f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' already exists",
                              409, "CONFLICT")
                op["_final"] = True
                return copy.deepcopy(self._public(op))
            if kind != "hang" or kw.get("create_instance", True):
                self._create_instance(zone, body, op["targetId"])
            if kind == "hang":
                self._hung.add(op["name"])
            self._pending_create[op["name"]] = (zone, name)
            return copy.deepcopy(self._public(op))

    def _create_instance(self, zone: str, body: dict, inst_id: str) -> None:
        inst = copy.deepcopy(body)
        name = inst["name"]
        mt = inst.get("machineType", "")
        if not mt.startswith("http"):
            mt = f"{API}/projects/{self.project}/{mt}"
        for acc in inst.get("guestAccelerators", []):
            if not acc.get("acceleratorType", "").startswith("http"):
                acc["acceleratorType"] = f"{API}/projects/{self.project}/{acc['acceleratorType']}"
        ip = next(self._ips)
        nics = inst.get("networkInterfaces") or [{"network": "global/networks/default"}]
        for i, nic in enumerate(nics):
            nic.setdefault("networkIP", f"10.128.{ip // 250}.{ip % 250 + i}")
            nic.setdefault("name", f"nic{i}")
        inst.update(kind="compute#instance", id=inst_id, machineType=mt, status="PROVISIONING",
                    zone=self._zone_url(zone), selfLink=f"{self._zone_url(zone)}/instances/{name}",
                    creationTimestamp=_now(), networkInterfaces=nics, labelFingerprint="42WmSpB8rSM=")
        self.instances[(zone, name)] = inst

    def _complete(self, op: dict) -> None:
        op.update(status="DONE", progress=100, endTime=_now())
        target = self._pending_create.pop(op["name"], None)
        if target and self.auto_run and target in self.instances:
            self.instances[target]["status"] = "RUNNING"
            self.instances[target]["lastStartTimestamp"] = _now()
        self._changed.notify_all()

    @staticmethod
    def _public(op: dict) -> dict:
        return {k: v for k, v in op.items() if not k.startswith("_")}

    def _get(self, zone: str, name: str) -> dict:
        with self._lock:
            inst = self.instances.get((zone, name))
            if not inst:
                raise GceHttpError(404, f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                                        "was not found", "notFound")
            return copy.deepcopy(inst)

    def _delete(self, zone: str, name: str, request_id: str | None) -> dict:
        with self._lock:
            if request_id and (zone, request_id) in self.request_ids:
                return copy.deepcopy(self._public(self.operations[self.request_ids[(zone, request_id)]]))
            inst = self.instances.get((zone, name))
            if not inst:
                raise GceHttpError(404, f"The resource 'projects/{self.project}/zones/{zone}/instances/{name}' "
                                        "was not found", "notFound")
            op = self._new_op(zone, name, inst["id"], "delete")
            if request_id:
                self.request_ids[(zone, request_id)] = op["name"]
            del self.instances[(zone, name)]
            op.update(status="DONE", progress=100, endTime=_now())
            self._changed.notify_all()
            return copy.deepcopy(self._public(op))

    def _list(self, zone: str, flt: str) -> dict:
        terms = parse_filter(flt)
        with self._lock:
            items = [copy.deepcopy(v) for (z, _), v in sorted(self.instances.items()) if z == zone and matches(v, terms)]
        out: dict[str, Any] = {"kind": "compute#instanceList", "id": f"projects/{self.project}/zones/{zone}/instances",
                               "selfLink": f"{self._zone_url(zone)}/instances"}
        if items:
            out["items"] = items
        return out

    def _aggregated(self, flt: str) -> dict:
        terms = parse_filter(flt)
        by_zone: dict[str, list] = defaultdict(list)
        with self._lock:
            zones = {z for z, _ in self.instances} | set(self._op_zone.values())
            for (z, _), v in sorted(self.instances.items()):
                if matches(v, terms):
                    by_zone[z].append(copy.deepcopy(v))
        items: dict[str, Any] = {}
        for z in sorted(zones):
            if by_zone.get(z):
                items[f"zones/{z}"] = {"instances": by_zone[z]}
            else:
                items[f"zones/{z}"] = {"warning": {"code": "NO_RESULTS_ON_PAGE",
                                                   "message": "There are no results for scope "
                                                              f"'zones/{z}' on this page.",
                                                   "data": [{"key": "scope", "value": f"zones/{z}"}]}}
        return {"kind": "compute#instanceAggregatedList", "id": f"projects/{self.project}/aggregated/instances",
                "items": items, "selfLink": f"{API}/projects/{self.project}/aggregated/instances"}

    # ---- regions ------------------------------------------------------------------------------

    def _get_region(self, region: str) -> dict:
        with self._lock:
            if self.region_faults[region]:
                status = self.region_faults[region].popleft()
                if status == 503:
                    raise GceHttpError(503, "Internal error. Please try again or contact Google Support.",
                                       "backendError")
                if status == 403:
                    raise GceHttpError(403, "Quota exceeded for quota metric 'Read requests' and limit "
                                            "'Read requests per minute' of service 'compute.googleapis.com'",
                                       "rateLimitExceeded", "usageLimits")
                raise GceHttpError(status, f"HTTP {status}", "error")
            zones = sorted({z for z, _ in self.instances} | set(self._op_zone.values()))
            out: dict[str, Any] = {
                "kind": "compute#region", "id": str(zlib.crc32(region.encode())), "name": region,
                "description": region, "status": "UP", "creationTimestamp": "1969-12-31T16:00:00.000-08:00",
                "zones": [self._zone_url(z) for z in zones if z.rsplit("-", 1)[0] == region],
                "quotas": [dict(q) for q in self.quotas.get(region, {}).values()],
                "selfLink": f"{API}/projects/{self.project}/regions/{region}"}
            return out

    # ---- operations ---------------------------------------------------------------------------

    def _get_op(self, zone: str, name: str, block: bool) -> dict:
        with self._lock:
            op = self.operations.get(name)
            if not op or self._op_zone.get(name) != zone:
                raise GceHttpError(404, f"The resource 'projects/{self.project}/zones/{zone}/operations/{name}' "
                                        "was not found", "notFound")
            if op["status"] != "DONE" and name not in self._hung:
                self._complete(op)  # finishes on the first read after the insert
            if block and op["status"] != "DONE":
                self._changed.wait_for(lambda: op["status"] == "DONE", timeout=self.wait_block_s)
            return copy.deepcopy(self._public(op))

    def _list_ops(self, zone: str, flt: str) -> dict:
        terms = parse_filter(flt)
        with self._lock:
            items = [copy.deepcopy(self._public(op)) for n, op in self.operations.items()
                     if self._op_zone[n] == zone and matches(op, terms)]
        out: dict[str, Any] = {"kind": "compute#operationList", "id": f"projects/{self.project}/zones/{zone}/operations",
                               "selfLink": f"{self._zone_url(zone)}/operations"}
        if items:
            out["items"] = items
        return out
