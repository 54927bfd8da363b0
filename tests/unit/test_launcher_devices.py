"""GPU assignment of `pdserve up` (pdserve/app/launcher/devices.py) and how the cluster hands it to backends.

No GPU and no process: the assignment is pure, and the cluster is driven with a recording backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.app.launcher.backends import WorkerHandle, device_env
from pdserve.app.launcher.cluster import Cluster, ClusterSpec
from pdserve.app.launcher.devices import DeviceAssigner, DevicePlan, assign, parse_ids, visible_gpus


def test_round_robin_in_launch_order_prefill_first() -> None:
    plan = DevicePlan(gpus_per_worker=1, visible=("0", "1"))
    assert assign(plan, ["prefill", "decode"]) == [("0",), ("1",)]
    plan4 = DevicePlan(gpus_per_worker=1, visible=("0", "1", "2", "3"))
    assert assign(plan4, ["prefill", "prefill", "decode", "decode"]) == [("0",), ("1",), ("2",), ("3",)]
    two = DevicePlan(gpus_per_worker=2, visible=("4", "5", "6", "7"))
    assert assign(two, ["prefill", "decode"]) == [("4", "5"), ("6", "7")]


def test_explicit_pool_lists_and_colocated_uses_the_decode_list() -> None:
    plan = DevicePlan(prefill_gpus=("0",), decode_gpus=("1", "2"))
    assert assign(plan, ["prefill", "decode", "decode"]) == [("0",), ("1",), ("2",)]
    assert assign(plan, ["colocated", "colocated"]) == [("1",), ("2",)]
    assert plan.ray_num_gpus("prefill") == 0  # explicit ids travel as CUDA_VISIBLE_DEVICES


def test_peers_see_every_gpu_own_first() -> None:
    plan = DevicePlan(gpus_per_worker=1, visible=("0", "1"), peers=True)
    assert assign(plan, ["prefill", "decode"]) == [("0", "1"), ("1", "0")]
    explicit = DevicePlan(prefill_gpus=("0",), decode_gpus=("1",), visible=("0", "1"), peers=True)
    assert assign(explicit, ["prefill", "decode"]) == [("0", "1"), ("1", "0")]
    assert plan.ray_num_gpus("decode") == 0  # Ray would hide the peer: ids are passed instead
    with pytest.raises(ValueError, match="gpu-peers"):
        DevicePlan(prefill_gpus=("0",), decode_gpus=("1",), peers=True)


def test_more_workers_than_gpus_wrap_around_with_a_warning(caplog) -> None:
    plan = DevicePlan(gpus_per_worker=1, visible=("0", "1"))
    with caplog.at_level("WARNING"):
        assert assign(plan, ["prefill", "decode", "decode"]) == [("0",), ("1",), ("0",)]
    assert "share devices" in caplog.text


def test_no_plan_means_inherit_and_bad_plans_are_refused() -> None:
    assert assign(DevicePlan(), ["prefill", "decode"]) == [(), ()]
    with pytest.raises(ValueError, match="both"):
        DevicePlan(prefill_gpus=("0",))
    with pytest.raises(ValueError, match="none visible"):
        DevicePlan(gpus_per_worker=1, visible=())
    with pytest.raises(ValueError, match=">= 0"):
        DevicePlan(gpus_per_worker=-1)
    with pytest.raises(ValueError, match="cannot give 2"):
        DevicePlan(gpus_per_worker=2, prefill_gpus=("0",), decode_gpus=("1", "2"))


def test_parse_and_visible() -> None:
    assert parse_ids(" 0, 1 ,") == ("0", "1") and parse_ids(None) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    env = {"A": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert device_env(env, ("1",)) == {"A": "1", "CUDA_VISIBLE_DEVICES": "1"}
    assert device_env({"A": "1"}, ()) == {"A": "1"}


class RecordingBackend:
    def __init__(self, name: str = "process") -> None:
        self.name = name
        self.started: list[tuple[str, str, tuple[str, ...], int]] = []
        self.args: dict[str, list[str]] = {}

    def start(self, role, args, name, *, devices=(), num_gpus=0) -> WorkerHandle:
        self.started.append((role, name, tuple(devices), num_gpus))
        self.args[name] = list(args)
        return WorkerHandle(role=role, worker_id=name, address=f"127.0.0.1:{len(self.started)}", pid=0,
                            backend=self, ref=None, devices=",".join(devices))


def _launch(spec: ClusterSpec, backend_name: str = "process") -> tuple[Cluster, RecordingBackend]:
    backend = RecordingBackend(backend_name)
    cluster = Cluster(spec=spec, backend=backend, run_dir=Path("/nonexistent"))
    launches = [(r, cluster._next_name(r)) for r, n in (("prefill", spec.num_prefill),
                                                        ("decode", spec.num_decode)) for _ in range(n)]
    for role, name in launches:  # what up() does, minus the thread pool and the router
        cluster.workers[role].append(cluster._start_worker(role, name, cluster._next_devices(role)))
    return cluster, backend


def test_cluster_gives_each_worker_its_gpu_and_scale_continues() -> None:
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=1,
                       devices=DevicePlan(gpus_per_worker=1, visible=("0", "1", "2")))
    cluster, backend = _launch(spec)
    assert backend.started == [("prefill", "prefill-1", ("0",), 0), ("decode", "decode-2", ("1",), 0)]
    assert cluster._next_devices("decode") == ("2",)  # a scale-up takes the next free GPU


def test_colocated_cluster_workers_and_ray_num_gpus() -> None:
    spec = ClusterSpec(model="m", num_prefill=0, num_decode=2, colocated=True,
                       devices=DevicePlan(gpus_per_worker=1, visible=("0", "1")))
    cluster, backend = _launch(spec)
    assert backend.started == [("colocated", "colocated-1", ("0",), 0),
                               ("colocated", "colocated-2", ("1",), 0)]
    # serve role colocated, pool decode; under Ray, round robin is a num_gpus request instead
    _, ray = _launch(spec, "ray")
    assert ray.started == [("colocated", "colocated-1", (), 1), ("colocated", "colocated-2", (), 1)]
    assert [h.role for h in cluster.workers["decode"]] == ["decode", "decode"]
    with pytest.raises(ValueError, match="colocated"):
        ClusterSpec(model="m", num_prefill=1, num_decode=2, colocated=True)
    with pytest.raises(ValueError, match="at least 1 prefill"):
        ClusterSpec(model="m", num_prefill=0, num_decode=2)


def test_device_assigner_is_stateful_per_pool() -> None:
    a = DeviceAssigner(DevicePlan(prefill_gpus=("0", "1"), decode_gpus=("2", "3")))
    assert [a.next("decode"), a.next("prefill"), a.next("decode"), a.next("prefill")] == [
        ("2",), ("0",), ("3",), ("1",)]


def test_per_pool_flags_follow_the_common_ones() -> None:
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=1, worker_args=("--max-num-seqs", "8"),
                       prefill_args=("--max-num-batched-tokens", "8192"), decode_args=("--kv-memory-gb", "9"))
    _, backend = _launch(spec)
    assert backend.args["prefill-1"][-4:] == ["--max-num-seqs", "8", "--max-num-batched-tokens", "8192"]
    assert backend.args["decode-2"][-4:] == ["--max-num-seqs", "8", "--kv-memory-gb", "9"]
    colo = ClusterSpec(model="m", num_prefill=0, num_decode=1, colocated=True, decode_args=("--x", "1"))
    _, backend = _launch(colo)
    assert backend.args["colocated-1"][-2:] == ["--x", "1"]


def test_each_worker_keeps_its_disk_tier_in_its_own_directory() -> None:
    """``--kv-disk-dir DIR`` in a cluster is DIR/<worker name>, wherever the flag came from (pdserve up,
    a pool's flags, a benchmark variant): workers on one host never share one, a restart finds its own."""
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2,
                       worker_args=("--kv-disk-dir", "/nvme/kv", "--kv-disk-gb", "50"),
                       decode_args=("--kv-host-gb", "64"))
    _, backend = _launch(spec)
    for name in ("prefill-1", "decode-2", "decode-3"):
        args = backend.args[name]
        assert args[args.index("--kv-disk-dir") + 1] == f"/nvme/kv/{name}"
        assert args[args.index("--kv-disk-gb") + 1] == "50"
    assert "--kv-host-gb" not in backend.args["prefill-1"] and "--kv-host-gb" in backend.args["decode-2"]
