"""A local fake Kubernetes API server, for the Kubernetes pool adapter's tests (``providers.kubernetes``).

It serves, on ``http://127.0.0.1:<port>`` (stdlib ``ThreadingHTTPServer`` in a thread, a bearer token required),
what the real ``kubernetes`` Python client sends for the resources the adapter uses::

    GET    /api/v1/nodes                                            list (labelSelector)
    GET    /api/v1/pods, /api/v1/namespaces/{ns}/pods               list (labelSelector, fieldSelector)
    GET    /api/v1/namespaces/{ns}/pods/{name}                      get
    GET    /api/v1/namespaces/{ns}/pods/{name}/log                  the container's output (text/plain; tailLines)
    GET    /api/v1/namespaces/{ns}/events                           list (fieldSelector)
    POST   /api/v1/namespaces/{ns}/services                         create
    GET    /api/v1/namespaces/{ns}/services[/{name}]                list (labelSelector) / get
    DELETE /api/v1/namespaces/{ns}/services/{name}                  delete
    GET    /apis/batch/v1/jobs, /apis/batch/v1/namespaces/{ns}/jobs list (labelSelector)
    POST   /apis/batch/v1/namespaces/{ns}/jobs                      create (409 AlreadyExists for a taken name)
    GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}               get
    PATCH  /apis/batch/v1/namespaces/{ns}/jobs/{name}               JSON merge patch (metadata, spec.suspend)
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}               delete (propagationPolicy in the query or body)

Errors are ``Status`` objects (``kind: Status``, ``reason``, ``code``) as the real API server answers them. No watch.

What it models, after Kubernetes 1.31+ (the batch Job controller, the scheduler and the kubelet in one loop,
:meth:`FakeK8s.tick`, run by a thread every ``tick_s``):

* **Job controller**: a Job that is not suspended gets its pods: one for ``completions`` 1, else one per index
  for ``completionMode: Indexed`` (pod ``<job>-<index>-<5 chars>``, hostname ``<job>-<index>``, subdomain from the
  template, label and annotation ``batch.kubernetes.io/job-completion-index``, labels ``batch.kubernetes.io/job-name``
  and ``job-name``, an ownerReference to the Job; a failed pod is not replaced, as the adapter's Jobs have
  ``backoffLimit: 0``). A pod failure beyond ``backoffLimit`` fails the Job
  (condition ``Failed``, reason ``BackoffLimitExceeded``) and deletes its pods still running; all indexes
  succeeded completes it (``Complete``); ``activeDeadlineSeconds`` past ``startTime`` fails it
  (``DeadlineExceeded``). ``status.active/succeeded/failed/startTime/completionTime`` are kept.
* **Scheduler**: a pending pod goes to the first node (by name) that is Ready, not cordoned, matches its
  ``nodeSelector``, tolerates the node's ``NoSchedule`` taints, holds no pod its required pod anti-affinity
  (``matchLabels``, topology ``kubernetes.io/hostname``) excludes and has the ``nvidia.com/gpu`` it requests free
  (allocatable minus the requests of the node's pods not finished). Otherwise the pod stays ``Pending`` with
  condition ``PodScheduled=False`` reason ``Unschedulable`` and a ``FailedScheduling`` Warning event, both saying
  ``0/N nodes are available: K Insufficient nvidia.com/gpu.`` (other reasons named the scheduler's way).
* **Kubelet**: a bound pod whose image is not :meth:`missing_image` starts its container: with ``run=True``
  (default) the container's ``command`` + ``args`` really run here as a local process (the image is not
  pulled) with the container's ``env`` (``value`` and ``valueFrom.fieldRef`` of ``metadata.name``,
  ``metadata.namespace``, ``spec.nodeName``, ``metadata.labels['k']``, ``metadata.annotations['k']``); its
  stdout and stderr are the pod log, its exit status the container's ``exitCode`` (``Completed`` for 0, else
  ``Error``). With ``run=False`` a container runs until :meth:`finish`. A missing image gives the container
  ``waiting`` ``ErrImagePull`` then, on the next tick, ``ImagePullBackOff`` and a ``Failed`` Warning event.
* Faults: :meth:`oom_kill` (``OOMKilled``, exit 137), :meth:`evict` (kubelet node-pressure eviction: phase
  ``Failed``, ``reason: Evicted``, ``DisruptionTarget`` reason ``TerminationByKubelet``), :meth:`node_lost`
  (the node goes ``Ready=Unknown``, its pods fail with ``DisruptionTarget`` reason ``DeletionByTaintManager``),
  :meth:`throttle` (the next requests answer 429 with ``Retry-After``), :meth:`fail_next` (any status, e.g.
  403 ``exceeded quota``), and a second create of a taken name is 409 ``AlreadyExists``.
* **Deletion**: an object with finalizers gets ``deletionTimestamp`` and stays until they are removed (a merge
  patch); ``propagationPolicy: Foreground`` deletes a Job's pods and Services at once, ``Background`` (the
  default) when the Job itself goes (the garbage collector follows ``ownerReferences``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKEN = "fake-k8s-token"
GPU = "nvidia.com/gpu"
PRODUCT = "nvidia.com/gpu.product"

_CORE = re.compile(r"^/api/v1(?:/namespaces/([^/]+))?/(pods|events|services|nodes)(?:/([^/]+))?(/log)?$")
_BATCH = re.compile(r"^/apis/batch/v1(?:/namespaces/([^/]+))?/jobs(?:/([^/]+))?$")
_FIELD_REF = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(ts: str | None) -> float | None:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp() if ts else None


class ApiError(Exception):
    """One error answer: HTTP ``code`` with a ``Status`` of ``reason`` and ``message``."""

    def __init__(self, code: int, reason: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, headers or {}

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "code": self.code}


def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``a=b,c!=d,e,!f,g in (x,y)`` -> ``[(key, op, values)]`` with op ``= != exists !exists in notin``;
    ``ApiError(400)`` for anything else."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", text or ""):
        part = part.strip().strip(",").strip()
        if not part:
            continue
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", part)
        if m:
            out.append((m.group(1), m.group(2), tuple(v.strip() for v in m.group(3).split(","))))
            continue
        m = re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)", part)
        if m:
            out.append((m.group(1), "!=" if m.group(2) == "!=" else "=", (m.group(3),)))
            continue
        m = re.fullmatch(r"(!?)([\w./-]+)", part)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        out.append((m.group(2), "!exists" if m.group(1) else "exists", ()))
    return out


def label_match(labels: dict, sel: list[tuple[str, str, tuple[str, ...]]]) -> bool:
    """Whether ``labels`` satisfy every requirement of ``sel`` (:func:`parse_label_selector`)."""
    for key, op, vals in sel:
        v = labels.get(key)
        ok = {"=": v == vals[0] if vals else False, "!=": v != vals[0], "exists": v is not None,
              "!exists": v is None, "in": v in vals, "notin": v not in vals}[op]
        if not ok:
            return False
    return True


def field_match(obj: dict, text: str) -> bool:
    """``status.phase!=Failed,involvedObject.name=x``: dotted paths compared as strings (absent = '')."""
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"([\w.]+)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {part!r}")
        cur: Any = obj
        for p in m.group(1).split("."):
            cur = cur.get(p) if isinstance(cur, dict) else None
        got = "" if cur is None else str(cur)
        if (got == m.group(3)) == (m.group(2) == "!="):
            return False
    return True


def _merge(dst: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch of ``patch`` into ``dst`` (in place)."""
    for k, v in patch.items():
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = json.loads(json.dumps(v))
    return dst


class FakeK8s:
    """In-memory Kubernetes API server; see the module docstring. Use as a context manager; :meth:`kubeconfig`
    writes a kubeconfig for it. ``run``: containers run their command here (else they run until :meth:`finish`)."""

    def __init__(self, run: bool = True, tick_s: float = 0.02):
        self.run = run
        self.tick_s = tick_s
        self.nodes: dict[str, dict] = {}
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.services: dict[tuple[str, str], dict] = {}
        self.events: list[dict] = []
        self.missing_images: set[str] = set()
        self.faults: deque[tuple[str | None, ApiError]] = deque()  # (method it waits for or None, error)
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, query)
        self.bodies: list[tuple[str, dict]] = []  # (path, body) of every POST/PATCH
        self._procs: dict[tuple[str, str], tuple[subprocess.Popen, Path]] = {}
        self._logs: dict[tuple[str, str], str] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._dir = Path(tempfile.mkdtemp(prefix="fake-k8s-"))
        self._server: ThreadingHTTPServer | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> "FakeK8s":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, body, headers = fake.handle(method, self.path, raw, self.headers.get("Authorization", ""),
                                                    self.headers.get("Content-Type", ""))
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def do_PATCH(self):
                self._serve("PATCH")

            def do_DELETE(self):
                self._serve("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-k8s", daemon=True).start()
        threading.Thread(target=self._loop, name="fake-k8s-controllers", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for proc, _ in self._procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeK8s":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def host(self) -> str:
        assert self._server, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, context: str = "fake", namespace: str = "default") -> Path:
        """Write a kubeconfig (YAML is JSON) whose context ``context`` reaches this server with its token."""
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": context,
               "clusters": [{"name": "fake", "cluster": {"server": self.host}}],
               "users": [{"name": "broker", "user": {"token": TOKEN}}],
               "contexts": [{"name": context,
                             "context": {"cluster": "fake", "user": "broker", "namespace": namespace}}]}
        path.write_text(json.dumps(cfg))
        return path

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    # ---- test helpers -------------------------------------------------------------------------------------
    def add_node(self, name: str, gpus: int, product: str | None = None, labels: dict | None = None,
                 taints: list[dict] | None = None, ready: bool = True, unschedulable: bool = False) -> dict:
        """A node with ``gpus`` allocatable ``nvidia.com/gpu`` and GFD label ``nvidia.com/gpu.product``."""
        lab = {"kubernetes.io/hostname": name, **({PRODUCT: product} if product else {}), **(labels or {})}
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "uid": str(uuid.uuid4()), "labels": lab, "creationTimestamp": _now()},
                "spec": {"taints": list(taints or []), **({"unschedulable": True} if unschedulable else {})},
                "status": {"capacity": {"cpu": "64", GPU: str(gpus)}, "allocatable": {"cpu": "64", GPU: str(gpus)},
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                           "reason": "KubeletReady"}]}}
        with self._lock:
            self.nodes[name] = node
        return node

    def add_pod(self, name: str, node: str | None, gpus: int, namespace: str = "other", phase: str = "Running",
                labels: dict | None = None, node_selector: dict | None = None) -> dict:
        """A pod not from the broker (someone else's workload) holding or waiting for ``gpus`` GPUs; one without a
        node is for another scheduler (``schedulerName: other-scheduler``), so it stays pending."""
        pod = self._new_pod(namespace, name, {"metadata": {"labels": labels or {}}, "spec": {
            "restartPolicy": "Never", **({"nodeSelector": node_selector} if node_selector else {}),
            **({} if node else {"schedulerName": "other-scheduler"}),
            "containers": [{"name": "main", "image": "other:1", "resources": {"limits": {GPU: str(gpus)}}}]}}, None)
        pod["status"]["phase"] = phase
        if node:
            pod["spec"]["nodeName"] = node
        with self._lock:
            self.pods[(namespace, name)] = pod
        return pod

    def missing_image(self, image: str) -> None:
        """Pulling ``image`` fails (``ErrImagePull``, then ``ImagePullBackOff``)."""
        with self._lock:
            self.missing_images.add(image)

    def throttle(self, n: int, retry_after_s: int | None = 1) -> None:
        """The next ``n`` requests answer 429 ``TooManyRequests`` (with ``Retry-After`` when given)."""
        with self._lock:
            for _ in range(n):
                self.faults.append((None, ApiError(429, "TooManyRequests", "Too many requests, please try again later.",
                                                   {"Retry-After": str(retry_after_s)} if retry_after_s is not None
                                                   else {})))

    def fail_next(self, code: int, reason: str, message: str, method: str | None = None) -> None:
        """The next request (the next ``method`` request, if given) answers HTTP ``code`` with this ``Status``."""
        with self._lock:
            self.faults.append((method, ApiError(code, reason, message)))

    def pods_of(self, job: str, namespace: str = "default") -> list[dict]:
        """The pods of Job ``job``, by completion index."""
        with self._lock:
            out = [p for (ns, _), p in self.pods.items()
                   if ns == namespace and p["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job]
            return sorted(out, key=lambda p: int(p["metadata"]["labels"].get(
                "batch.kubernetes.io/job-completion-index", "0")))

    def wait_pods(self, job: str, phase: str, n: int = 1, timeout_s: float = 10.0,
                  namespace: str = "default") -> list[dict]:
        """Wait until ``n`` pods of ``job`` are in ``phase``; ``TimeoutError`` otherwise."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            pods = [p for p in self.pods_of(job, namespace) if p["status"]["phase"] == phase]
            if len(pods) >= n:
                return pods
            time.sleep(0.02)
        raise TimeoutError(f"{job}: not {n} pods {phase}: {[p['status']['phase'] for p in self.pods_of(job)]}")

    def finish(self, pod: str, exit_code: int, reason: str | None = None, namespace: str = "default") -> None:
        """End the container of ``pod`` with ``exit_code`` (and terminated ``reason``, default Completed/Error)."""
        with self._lock:
            p = self.pods[(namespace, pod)]
            self._kill_proc((namespace, pod))
            self._terminate(p, exit_code, reason or ("Completed" if exit_code == 0 else "Error"))

    def oom_kill(self, pod: str, namespace: str = "default") -> None:
        """The kernel's OOM killer ends the container (``OOMKilled``, exit code 137)."""
        self.finish(pod, 137, "OOMKilled", namespace)

    def evict(self, pod: str, namespace: str = "default",
              message: str = "The node was low on resource: memory. ") -> None:
        """The kubelet evicts ``pod`` for node pressure (phase Failed, reason Evicted, DisruptionTarget)."""
        with self._lock:
            p = self.pods[(namespace, pod)]
            self._kill_proc((namespace, pod))
            self._terminate(p, 137, "Error")
            p["status"].update(reason="Evicted", message=message)
            p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                              "reason": "TerminationByKubelet", "message": message.strip(),
                                              "lastTransitionTime": _now()})
            self._event(p, "Warning", "Evicted", message.strip())

    def node_lost(self, node: str) -> None:
        """``node`` stops answering: ``Ready=Unknown``; the taint manager deletes its pods (DisruptionTarget)."""
        with self._lock:
            n = self.nodes[node]
            n["status"]["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                          "message": "Kubelet stopped posting node status."}]
            n["spec"]["taints"] = [*n["spec"].get("taints", []),
                                   {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]
            for key, p in list(self.pods.items()):
                if p["spec"].get("nodeName") == node and p["status"]["phase"] in ("Pending", "Running"):
                    self._kill_proc(key)
                    self._terminate(p, 137, "Error")
                    p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                                      "reason": "DeletionByTaintManager",
                                                      "message": "Taint manager: deleting due to NoExecute taint",
                                                      "lastTransitionTime": _now()})

    def unsuspend(self, job: str, namespace: str = "default") -> None:
        """What Kueue does when it admits a workload: ``spec.suspend = false``."""
        with self._lock:
            self.jobs[(namespace, job)]["spec"]["suspend"] = False

    # ---- the HTTP API -------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, raw: bytes, auth: str = f"Bearer {TOKEN}",
               content_type: str = "application/json") -> tuple[int, Any, dict]:
        """One request -> ``(status, body, headers)``; the body is a dict (JSON) or a str (a pod log). A PATCH must
        be a JSON merge patch (``application/merge-patch+json``; the fake applies no strategic merge)."""
        url = urlsplit(path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self._lock:
            self.requests.append((method, url.path, q))
            try:
                if auth != f"Bearer {TOKEN}":
                    raise ApiError(401, "Unauthorized", "Unauthorized")
                fault = next((f for f in self.faults if f[0] in (None, method)), None)
                if fault:
                    self.faults.remove(fault)
                    raise fault[1]
                if method == "PATCH" and content_type.split(";")[0] != "application/merge-patch+json":
                    raise ApiError(415, "UnsupportedMediaType", f"the fake applies merge patches only, not "
                                   f"{content_type!r}")
                body = json.loads(raw) if raw else {}
                if method in ("POST", "PATCH"):
                    self.bodies.append((url.path, body))
                return 200 if method != "POST" else 201, self._route(method, url.path, q, body), {}
            except ApiError as e:
                return e.code, e.status(), e.headers

    def _route(self, method: str, path: str, q: dict, body: dict) -> Any:
        m = _BATCH.match(path)
        if m:
            return self._resource(method, self.jobs, "Job", "batch/v1", m.group(1), m.group(2), q, body)
        m = _CORE.match(path)
        if not m:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, kind, name, log = m.groups()
        if kind == "nodes":
            if method != "GET" or name:
                raise ApiError(405, "MethodNotAllowed", "only list of nodes is served")
            return self._list("NodeList", "v1", self.nodes.values(), q)
        if kind == "events":
            evs = [e for e in self.events if ns is None or e["metadata"]["namespace"] == ns]
            return self._list("EventList", "v1", evs, q)
        store = self.pods if kind == "pods" else self.services
        if log:
            pod = self._get(store, "pods", ns, name)
            text = self._log_text((ns, name)) if pod["status"]["phase"] != "Pending" else None
            if text is None:
                raise ApiError(400, "BadRequest", f'container "main" in pod "{name}" is waiting to start')
            if q.get("tailLines"):
                text = "".join(text.splitlines(keepends=True)[-int(q["tailLines"]):])
            return text
        return self._resource(method, store, "Pod" if kind == "pods" else "Service", "v1", ns, name, q, body)

    def _resource(self, method: str, store: dict, kind: str, api: str, ns: str | None, name: str | None,
                  q: dict, body: dict) -> dict:
        plural = kind.lower() + "s"
        if method == "GET" and not name:
            return self._list(kind + "List", api, [o for (n, _), o in store.items() if ns is None or n == ns], q)
        if method == "GET":
            return self._get(store, plural, ns, name)
        if method == "POST":
            if kind == "Pod":
                raise ApiError(405, "MethodNotAllowed", "the fake creates pods through Jobs only")
            obj = json.loads(json.dumps(body))
            meta = obj.setdefault("metadata", {})
            meta.setdefault("namespace", ns)
            key = (ns, meta.get("name", ""))
            if not key[1]:
                raise ApiError(422, "Invalid", f"{kind} is invalid: metadata.name: Required value")
            if key in store:
                raise ApiError(409, "AlreadyExists", f'{plural}.{api.split("/")[0] if "/" in api else ""}'
                               .rstrip(".") + f' "{key[1]}" already exists')
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(next(self._ids)))
            obj.update(apiVersion=api, kind=kind)
            if kind == "Job":
                self._default_job(obj)
            store[key] = obj
            return obj
        obj = self._get(store, plural, ns, name)
        if method == "PATCH":
            _merge(obj, body)
            obj["metadata"]["resourceVersion"] = str(next(self._ids))
            self._maybe_gone(store, (ns, name))
            return obj
        if method == "DELETE":
            policy = q.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
            obj["metadata"].setdefault("deletionTimestamp", _now())
            if policy == "Foreground":
                self._delete_dependents(obj)
            self._maybe_gone(store, (ns, name))
            return obj
        raise ApiError(405, "MethodNotAllowed", method)

    def _get(self, store: dict, plural: str, ns: str | None, name: str | None) -> dict:
        try:
            return store[(ns, name)]
        except KeyError:
            raise ApiError(404, "NotFound", f'{plural} "{name}" not found') from None

    def _list(self, kind: str, api: str, objs, q: dict) -> dict:
        sel = parse_label_selector(q.get("labelSelector", ""))
        items = [o for o in objs if label_match(o["metadata"].get("labels") or {}, sel)
                 and field_match(o, q.get("fieldSelector", ""))]
        return {"kind": kind, "apiVersion": api, "metadata": {"resourceVersion": str(next(self._ids))},
                "items": items}

    def _maybe_gone(self, store: dict, key: tuple[str, str]) -> None:
        obj = store.get(key)
        if obj is None or not obj["metadata"].get("deletionTimestamp") or obj["metadata"].get("finalizers"):
            return
        del store[key]
        self._delete_dependents(obj)  # the garbage collector (Background: after the owner is gone)

    def _delete_dependents(self, owner: dict) -> None:
        uid = owner["metadata"]["uid"]
        for store in (self.pods, self.services):
            for key, o in list(store.items()):
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or []):
                    if store is self.pods:
                        self._kill_proc(key)
                    del store[key]

    # ---- controllers --------------------------------------------------------------------------------------
    @staticmethod
    def _default_job(job: dict) -> None:
        spec = job.setdefault("spec", {})
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        job["status"] = {}

    def _new_pod(self, ns: str, name: str, template: dict, job: dict | None, index: int | None = None) -> dict:
        t = json.loads(json.dumps(template))
        meta = t.get("metadata") or {}
        labels, ann = dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})
        spec = t.get("spec") or {}
        if job is not None:
            labels.update({"batch.kubernetes.io/job-name": job["metadata"]["name"],
                           "job-name": job["metadata"]["name"],
                           "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]})
        if index is not None:
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            ann["batch.kubernetes.io/job-completion-index"] = str(index)
            spec["hostname"] = f"{job['metadata']['name']}-{index}"
        owner = ([{"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
                   "uid": job["metadata"]["uid"], "controller": True}] if job is not None else [])
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "labels": labels,
                             "annotations": ann, "ownerReferences": owner, "creationTimestamp": _now()},
                "spec": spec, "status": {"phase": "Pending", "conditions": []}}

    def _event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        m = obj["metadata"]
        self.events.append({"apiVersion": "v1", "kind": "Event", "type": type_, "reason": reason, "message": message,
                            "metadata": {"name": f"{m['name']}.{next(self._ids):x}", "namespace": m["namespace"]},
                            "involvedObject": {"kind": obj["kind"], "name": m["name"], "namespace": m["namespace"],
                                               "uid": m["uid"]},
                            "lastTimestamp": _now(), "count": 1})

    def tick(self) -> None:
        """One pass of the Job controller, the scheduler and the kubelet."""
        with self._lock:
            for job in list(self.jobs.values()):
                self._job_controller(job)
            for key, pod in sorted(self.pods.items(), key=lambda kv: kv[1]["metadata"]["creationTimestamp"]):
                self._schedule(pod)
                self._kubelet(key, pod)
            for job in list(self.jobs.values()):
                self._job_status(job)

    def _job_controller(self, job: dict) -> None:
        spec, st = job["spec"], job["status"]
        if spec.get("suspend") or job["metadata"].get("deletionTimestamp") or st.get("conditions"):
            return
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        have = [p for p in self.pods.values() if p["metadata"]["labels"].get("batch.kubernetes.io/controller-uid")
                == job["metadata"]["uid"]]
        st.setdefault("startTime", _now())
        if spec["completionMode"] == "Indexed":
            got = {int(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]) for p in have}
            for i in range(spec["completions"]):
                if i not in got:
                    pname = f"{name}-{i}-{uuid.uuid4().hex[:5]}"
                    self.pods[(ns, pname)] = self._new_pod(ns, pname, spec["template"], job, i)
        elif not have:
            pname = f"{name}-{uuid.uuid4().hex[:5]}"
            self.pods[(ns, pname)] = self._new_pod(ns, pname, spec["template"], job)

    def _job_status(self, job: dict) -> None:
        spec, st = job["spec"], job["status"]
        if spec.get("suspend") or st.get("conditions"):
            return
        pods = [p for p in self.pods.values() if p["metadata"]["labels"].get("batch.kubernetes.io/controller-uid")
                == job["metadata"]["uid"]]
        phases = [p["status"]["phase"] for p in pods]
        st.update(active=sum(ph in ("Pending", "Running") for ph in phases),
                  succeeded=phases.count("Succeeded"), failed=phases.count("Failed"))
        cond = None
        if st["failed"] > spec["backoffLimit"]:
            cond = ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        elif spec.get("activeDeadlineSeconds") is not None and st.get("startTime") and \
                time.time() - _epoch(st["startTime"]) > spec["activeDeadlineSeconds"]:
            cond = ("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
        elif st["succeeded"] >= spec["completions"]:
            cond = ("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
            st["completionTime"] = _now()
        if cond:
            st["conditions"] = [{"type": cond[0], "status": "True", "reason": cond[1], "message": cond[2],
                                 "lastTransitionTime": _now()}]
            self._event(job, "Normal" if cond[0] == "Complete" else "Warning", cond[1], cond[2])
            if cond[0] == "Failed":  # the controller deletes the pods still active
                for key, p in list(self.pods.items()):
                    if p in pods and p["status"]["phase"] in ("Pending", "Running"):
                        self._kill_proc(key)
                        del self.pods[key]
            st["active"] = 0

    def _gpus(self, pod: dict) -> int:
        return sum(int((c.get("resources") or {}).get("limits", {}).get(GPU, 0) or
                       (c.get("resources") or {}).get("requests", {}).get(GPU, 0))
                   for c in pod["spec"].get("containers", []))

    def _schedule(self, pod: dict) -> None:
        if pod["spec"].get("nodeName") or pod["status"]["phase"] != "Pending" or \
                pod["spec"].get("schedulerName", "default-scheduler") != "default-scheduler":
            return
        want = self._gpus(pod)
        why: dict[str, int] = {}
        for name in sorted(self.nodes):
            node = self.nodes[name]
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
            tol = pod["spec"].get("tolerations") or []
            untolerated = [t for t in node["spec"].get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")
                           and not any(o.get("key") == t["key"] and (o.get("operator") == "Exists"
                                                                      or o.get("value") == t.get("value"))
                                       and o.get("effect") in (None, "", t["effect"]) for o in tol)]
            sel = pod["spec"].get("nodeSelector") or {}
            free = int(node["status"]["allocatable"].get(GPU, 0)) - sum(
                self._gpus(p) for p in self.pods.values()
                if p["spec"].get("nodeName") == name and p["status"]["phase"] in ("Pending", "Running"))
            if not ready:
                why["node(s) were not ready"] = why.get("node(s) were not ready", 0) + 1
            elif node["spec"].get("unschedulable"):
                why["node(s) were unschedulable"] = why.get("node(s) were unschedulable", 0) + 1
            elif untolerated:
                k = f"node(s) had untolerated taint {{{untolerated[0]['key']}: }}"
                why[k] = why.get(k, 0) + 1
            elif any(node["metadata"]["labels"].get(k) != v for k, v in sel.items()):
                why["node(s) didn't match Pod's node affinity/selector"] = \
                    why.get("node(s) didn't match Pod's node affinity/selector", 0) + 1
            elif self._anti_affinity_blocks(pod, name):
                k = "node(s) didn't match pod anti-affinity rules"
                why[k] = why.get(k, 0) + 1
            elif free < want:
                why[f"Insufficient {GPU}"] = why.get(f"Insufficient {GPU}", 0) + 1
            else:
                pod["spec"]["nodeName"] = name
                pod["status"]["conditions"] = [c for c in pod["status"]["conditions"] if c["type"] != "PodScheduled"]
                pod["status"]["conditions"].append({"type": "PodScheduled", "status": "True"})
                return
        total = len(self.nodes)
        msg = (f"0/{total} nodes are available: " + ", ".join(f"{n} {k}" for k, n in sorted(why.items()))
               + f". preemption: 0/{total} nodes are available: {total} No preemption victims found for incoming pod.")
        conds = [c for c in pod["status"]["conditions"] if c["type"] != "PodScheduled"]
        pod["status"]["conditions"] = conds + [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "message": msg, "lastTransitionTime": _now()}]
        if not any(e["involvedObject"]["uid"] == pod["metadata"]["uid"] and e["reason"] == "FailedScheduling"
                   for e in self.events):
            self._event(pod, "Warning", "FailedScheduling", msg)

    def _anti_affinity_blocks(self, pod: dict, node: str) -> bool:
        """A required pod anti-affinity term (``matchLabels``, topology ``kubernetes.io/hostname``) matches a pod
        already on ``node``."""
        terms = (((pod["spec"].get("affinity") or {}).get("podAntiAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        for t in terms:
            if t.get("topologyKey") != "kubernetes.io/hostname":
                raise ApiError(422, "Invalid", f"the fake knows topologyKey kubernetes.io/hostname only, not {t!r}")
            want = (t.get("labelSelector") or {}).get("matchLabels") or {}
            for other in self.pods.values():
                if other is not pod and other["spec"].get("nodeName") == node and \
                        other["status"]["phase"] in ("Pending", "Running") and \
                        all(other["metadata"]["labels"].get(k) == v for k, v in want.items()):
                    return True
        return False

    def _env(self, pod: dict, container: dict) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": pod["spec"].get("hostname")
               or pod["metadata"]["name"]}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
                continue
            path = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
            m = _FIELD_REF.match(path)
            if m:
                env[e["name"]] = pod["metadata"].get(m.group(1), {}).get(m.group(2), "")
            elif path in ("metadata.name", "metadata.namespace"):
                env[e["name"]] = pod["metadata"][path.split(".")[1]]
            elif path == "spec.nodeName":
                env[e["name"]] = pod["spec"].get("nodeName", "")
            else:
                raise ApiError(422, "Invalid", f"unsupported fieldPath {path!r}")
        return env

    def _kubelet(self, key: tuple[str, str], pod: dict) -> None:
        st = pod["status"]
        if not pod["spec"].get("nodeName") or st["phase"] != "Pending":
            if key in self._procs and st["phase"] == "Running":
                proc, out = self._procs[key]
                if proc.poll() is not None:
                    self._logs[key] = out.read_text(errors="replace")
                    del self._procs[key]
                    self._terminate(pod, proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
                                    "Completed" if proc.returncode == 0 else "Error")
            return
        c = pod["spec"]["containers"][0]
        if c["image"] in self.missing_images:
            waiting = (st.get("containerStatuses") or [{}])[0].get("state", {}).get("waiting", {})
            if waiting.get("reason") == "ErrImagePull":
                msg = f'Back-off pulling image "{c["image"]}"'
                st["containerStatuses"] = [{"name": c["name"], "image": c["image"], "ready": False, "restartCount": 0,
                                            "state": {"waiting": {"reason": "ImagePullBackOff", "message": msg}}}]
                self._event(pod, "Normal", "BackOff", msg)
                self._event(pod, "Warning", "Failed", "Error: ImagePullBackOff")
            elif not waiting:
                msg = (f'Failed to pull image "{c["image"]}": rpc error: code = NotFound desc = failed to pull and '
                       f'unpack image "{c["image"]}": not found')
                st["containerStatuses"] = [{"name": c["name"], "image": c["image"], "ready": False, "restartCount": 0,
                                            "state": {"waiting": {"reason": "ErrImagePull", "message": msg}}}]
                self._event(pod, "Warning", "Failed", msg)
            return
        st.update(phase="Running", startTime=_now(), podIP=f"10.0.0.{next(self._ids) % 250 + 2}",
                  containerStatuses=[{"name": c["name"], "image": c["image"], "ready": True, "restartCount": 0,
                                      "started": True, "state": {"running": {"startedAt": _now()}}}])
        argv = [*(c.get("command") or []), *(c.get("args") or [])]
        if self.run and argv:
            out = self._dir / f"{key[0]}-{key[1]}.log"
            with out.open("wb") as fh:
                proc = subprocess.Popen(argv, env=self._env(pod, c), stdout=fh, stderr=subprocess.STDOUT,
                                        cwd=self._dir, start_new_session=True)
            self._procs[key] = (proc, out)

    def _kill_proc(self, key: tuple[str, str]) -> None:
        got = self._procs.pop(key, None)
        if got:
            proc, out = got
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self._logs[key] = out.read_text(errors="replace")

    def _log_text(self, key: tuple[str, str]) -> str | None:
        if key in self._procs:
            return self._procs[key][1].read_text(errors="replace")
        return self._logs.get(key, "")

    def _terminate(self, pod: dict, code: int, reason: str) -> None:
        st = pod["status"]
        c = pod["spec"]["containers"][0]
        st["phase"] = "Succeeded" if code == 0 else "Failed"
        st["containerStatuses"] = [{"name": c["name"], "image": c["image"], "ready": False, "restartCount": 0,
                                    "state": {"terminated": {"exitCode": code, "reason": reason,
                                                             "startedAt": st.get("startTime", _now()),
                                                             "finishedAt": _now()}}}]
