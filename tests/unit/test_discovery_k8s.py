"""K8sDiscovery against a local HTTP server speaking the real API's EndpointSlice list/watch JSON.

The fake API server (http.server in a thread) serves the ``discovery.k8s.io`` group document (which
versions it serves: v1, or only v1beta1 as Kubernetes 1.20 does) and ``/apis/discovery.k8s.io/
{version}/namespaces/{ns}/endpointslices``: LIST with ``labelSelector`` returns an EndpointSliceList with a
``resourceVersion``; ``watch=true`` streams chunked ADDED/MODIFIED/DELETED events after the given
``resourceVersion`` and answers a compacted (too old) version with a 410 ``Expired`` ERROR event,
exactly as the API server does. The real ``kubernetes`` client talks to it through a generated
kubeconfig file.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.placement_fakes import request
from router.discovery import make_discovery
from router.discovery.k8s import K8sDiscovery, K8sDiscoveryConfig, slice_workers
from router.placement import Placer, PlacerConfig

pytestmark = pytest.mark.timeout(60)

PATH = "/apis/discovery.k8s.io/{version}/namespaces/{ns}/endpointslices"


def make_slice(name: str, service: str, endpoints: list[tuple[str, str, bool]], port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "llm", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        # as a real slice may list them: not in the Service's order (the router must pick "grpc" by name)
        "ports": [{"name": "metrics", "port": 9000}, {"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip],
                       "conditions": {"ready": ready, "serving": ready, "terminating": False},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm", "uid": f"uid-{pod}"}}
                      for pod, ip, ready in endpoints],
    }


class FakeApi:
    def __init__(self, version: str = "v1") -> None:
        self.version = version  # the one discovery.k8s.io version served
        self.cond = threading.Condition()
        self.rv = 100
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.compacted = 0  # versions <= this are gone
        self.lists = 0
        self.watches = 0
        self.gone_sent = 0

    def _bump(self, obj: dict) -> dict:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def put(self, obj: dict, event: bool = True) -> None:
        if self.version == "v1beta1":  # Kubernetes 1.20's shape: `ready` only, a topology map
            obj = copy.deepcopy(obj)
            obj["apiVersion"] = "discovery.k8s.io/v1beta1"
            for ep in obj["endpoints"]:
                ep["conditions"] = {k: v for k, v in ep["conditions"].items() if k == "ready"}
                ep["topology"] = {"kubernetes.io/hostname": "node-1"}
        with self.cond:
            kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
            obj = self._bump(obj)
            self.slices[obj["metadata"]["name"]] = obj
            if event:
                self.events.append((self.rv, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            obj = self._bump(self.slices.pop(name))
            self.events.append((self.rv, "DELETED", obj))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget history (etcd compaction) and end open watches, as an API server restart would."""
        with self.cond:
            self.compacted = self.rv
            self.events.clear()
            self.cond.notify_all()

    @staticmethod
    def _match(obj: dict, selector: str) -> bool:
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            k, _, v = term.partition("=")
            if labels.get(k) != v:
                return False
        return True


def make_handler(api: FakeApi):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _chunk(self, obj: dict) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_GET(self):  # noqa: N802 - http.server's naming
            url = urllib.parse.urlparse(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            if url.path.rstrip("/") == "/apis/discovery.k8s.io":
                gv = {"groupVersion": f"discovery.k8s.io/{api.version}", "version": api.version}
                return self._json(200, {"kind": "APIGroup", "apiVersion": "v1", "name": "discovery.k8s.io",
                                        "versions": [gv], "preferredVersion": gv})
            if url.path != PATH.format(version=api.version, ns="llm"):
                return self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404, "metadata": {}})
            sel = q.get("labelSelector", "")
            if q.get("watch") not in ("true", "1"):
                with api.cond:
                    api.lists += 1
                    items = [s for s in api.slices.values() if api._match(s, sel)]
                    return self._json(200, {"apiVersion": f"discovery.k8s.io/{api.version}",
                                            "kind": "EndpointSliceList",
                                            "metadata": {"resourceVersion": str(api.rv)}, "items": items})
            since = int(q.get("resourceVersion") or 0)
            deadline = time.monotonic() + float(q.get("timeoutSeconds", "5"))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with api.cond:
                api.watches += 1
                epoch = api.compacted
            try:
                if since and since <= api.compacted:
                    api.gone_sent += 1
                    self._chunk({"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": f"too old resource version: {since} ({api.compacted})",
                        "reason": "Expired", "code": 410}})
                else:
                    while time.monotonic() < deadline:
                        with api.cond:
                            if api.compacted != epoch:
                                break  # the watch is cut; the client resumes and meets the 410
                            pending = [(rv, k, o) for rv, k, o in api.events
                                       if rv > since and api._match(o, sel)]
                            if not pending:
                                api.cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                                continue
                        for rv, kind, obj in pending:
                            self._chunk({"type": kind, "object": obj})
                            since = rv
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


@pytest.fixture(params=["v1", "v1beta1"])
def fake_api(tmp_path, request):
    api = FakeApi(request.param)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(api))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({  # JSON is YAML: a kubeconfig the client loads like any other
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{srv.server_address[1]}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "llm"}}],
    }))
    yield api, str(kubeconfig)
    srv.shutdown()
    srv.server_close()


async def _wait_for(updates: asyncio.Queue, pred, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.wait_for(updates.get(), max(0.01, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
        if pred({w.worker_id: w for w in last}):
            return {w.worker_id: w for w in last}
    raise AssertionError(f"discovery never reached the expected state; last update: {last}")


def test_list_watch_events_and_410_relist(fake_api):
    api, kubeconfig = fake_api
    api.put(make_slice("prefill-a", "pd-prefill", [("pf-0", "10.1.0.1", True), ("pf-1", "10.1.0.2", True)],
                       7001))
    api.put(make_slice("decode-a", "pd-decode", [("dc-0", "10.2.0.1", True), ("dc-1", "10.2.0.2", False)],
                       7002))
    api.put(make_slice("other", "unrelated", [("x-0", "10.9.0.1", True)], 80))

    async def main():
        cfg = K8sDiscoveryConfig(namespace="llm", prefill_selector="kubernetes.io/service-name=pd-prefill",
                                 decode_selector="kubernetes.io/service-name=pd-decode",
                                 kubeconfig=kubeconfig, watch_timeout_s=1, backoff_base_s=0.05)
        disc = K8sDiscovery(cfg)
        placer = Placer(PlacerConfig())
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(ws):
            placer.update_workers(ws)
            updates.put_nowait(ws)

        task = asyncio.get_running_loop().create_task(disc.run(on_update))
        got = await _wait_for(updates, lambda m: set(m) == {"pf-0", "pf-1", "dc-0"})
        assert disc.api_version == api.version  # the version the server serves, not a fixed one
        assert got["pf-0"].address == "10.1.0.1:7001" and got["pf-0"].role == "prefill"
        assert got["dc-0"].incarnation == "uid-dc-0" and got["dc-0"].role == "decode"
        assert placer.place(request("r", list(range(64)))).decode.worker_id == "dc-0"

        # MODIFIED: dc-1 becomes ready.
        api.put(make_slice("decode-a", "pd-decode", [("dc-0", "10.2.0.1", True), ("dc-1", "10.2.0.2", True)],
                           7002))
        await _wait_for(updates, lambda m: "dc-1" in m)
        # ADDED: a second decode slice; DELETED: the prefill slice goes away.
        api.put(make_slice("decode-b", "pd-decode", [("dc-2", "10.2.0.3", True)], 7002))
        await _wait_for(updates, lambda m: "dc-2" in m)
        api.delete("prefill-a")
        await _wait_for(updates, lambda m: not any(w.startswith("pf-") for w in m))
        assert not [w for w in placer.view.workers if w.startswith("pf-")]

        # 410 Gone: history is compacted while a change happens without an event; only a re-list
        # can see it. The client's resume point is too old -> ERROR 410 -> LIST again.
        lists_before = api.lists
        api.compact()
        api.put(make_slice("prefill-b", "pd-prefill", [("pf-7", "10.1.0.7", True)], 7001), event=False)
        api.compact()
        got = await _wait_for(updates, lambda m: "pf-7" in m)
        assert set(got) == {"pf-7", "dc-0", "dc-1", "dc-2"}
        assert api.gone_sent >= 1 and api.lists > lists_before
        assert sum(w.gone for w in disc.watchers) >= 1
        # The watch resumed after the re-list: later events still arrive.
        both = [("pf-7", "10.1.0.7", True), ("pf-8", "10.1.0.8", True)]
        api.put(make_slice("prefill-b", "pd-prefill", both, 7001))
        await _wait_for(updates, lambda m: "pf-8" in m)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        disc.stop()

    asyncio.run(main())


def test_api_errors_back_off_and_keep_last_view(fake_api):
    api, kubeconfig = fake_api
    api.put(make_slice("prefill-a", "pd-prefill", [("pf-0", "10.1.0.1", True)], 7001))
    api.put(make_slice("decode-a", "pd-decode", [("dc-0", "10.2.0.1", True)], 7002))

    async def main():
        cfg = K8sDiscoveryConfig(namespace="wrong-ns",
                                 prefill_selector="kubernetes.io/service-name=pd-prefill",
                                 decode_selector="kubernetes.io/service-name=pd-decode",
                                 kubeconfig=kubeconfig,
                                 watch_timeout_s=1, backoff_base_s=0.05, backoff_max_s=0.2)
        disc = K8sDiscovery(cfg)
        seen = []
        task = asyncio.get_running_loop().create_task(disc.run(seen.append))
        for _ in range(400):  # polls end as soon as the errors are in; the bound is for slow machines
            await asyncio.sleep(0.05)
            if disc.errors >= 4:
                break
        assert disc.errors >= 4 and seen == []  # 404s are retried with backoff, nothing invented
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_slice_parsing_and_factory():
    from kubernetes.client import ApiClient

    raw = make_slice("s", "svc", [("a", "10.0.0.1", True), ("b", "10.0.0.2", False), ("c", "fd00::1", True)],
                     7002)
    raw["endpoints"].append({"addresses": ["10.0.0.4"], "conditions": {}})  # ready unknown = ready
    obj = ApiClient()._ApiClient__deserialize(raw, "V1EndpointSlice")
    ws = slice_workers("decode", obj, "grpc")
    assert [(w.worker_id, w.address) for w in ws] == [
        ("a", "10.0.0.1:7002"), ("c", "[fd00::1]:7002"), ("decode@10.0.0.4:7002", "10.0.0.4:7002")]
    assert slice_workers("decode", obj, "nope") == []
    with pytest.raises(ValueError):
        K8sDiscoveryConfig(prefill_selector="")
    st = make_discovery("static", prefill="h:1,p9=h:2", decode=["h:3"])
    assert [w.worker_id for w in st.current()] == ["prefill@h:1", "p9", "decode@h:3"]
    with pytest.raises(ValueError):
        make_discovery("static", prefill="nohostport")
    with pytest.raises(ValueError):
        make_discovery("redis")


def test_feed_directory_mirrors_static_lists():
    from router.discovery import feed_directory

    class Dir:
        def __init__(self) -> None:
            self.calls: list[tuple[str, list[str]]] = []

        async def set_addresses(self, role, addrs):
            self.calls.append((role, sorted(addrs)))

    async def main():
        d = Dir()
        src = make_discovery("static", prefill="h:1", decode="h:2,h:3")
        task = asyncio.ensure_future(feed_directory(src, d))
        for _ in range(1000):
            await asyncio.sleep(0.01)
            if len(d.calls) == 2:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert d.calls == [("prefill", ["h:1"]), ("decode", ["h:2", "h:3"])]

    asyncio.run(main())
