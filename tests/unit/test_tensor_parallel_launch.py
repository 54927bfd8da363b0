"""`pdserve up --prefill-tp N --decode-tp M`: each pool's serve flags, each worker's N GPUs (process launcher:
CUDA_VISIBLE_DEVICES; Ray: a num_gpus request held by one STRICT_PACK placement-group bundle), and the
Ray bundle itself on a local Ray that advertises logical GPUs."""

from __future__ import annotations

import pytest
from test_launcher_devices import _launch

from pdserve.app.launcher.cluster import ClusterSpec
from pdserve.app.launcher.devices import DevicePlan, assign
from pdserve.app.tp_ranks import KVRankConfig, pool_tp_args


def test_pool_flags_follow_the_tp_sizes() -> None:
    assert pool_tp_args(prefill_tp=1, decode_tp=1) == ([], [])
    assert pool_tp_args(prefill_tp=2, decode_tp=1) == (["--tensor-parallel-size", "2"],
                                                       ["--kv-source-tp", "2"])
    assert pool_tp_args(prefill_tp=1, decode_tp=2) == ([], ["--tensor-parallel-size", "2"])
    assert pool_tp_args(prefill_tp=1, decode_tp=4, colocated=True) == ([], ["--tensor-parallel-size", "4"])
    with pytest.raises(ValueError, match="colocated"):
        pool_tp_args(prefill_tp=2, decode_tp=2, colocated=True)
    with pytest.raises(ValueError, match=">= 1"):
        pool_tp_args(prefill_tp=0, decode_tp=1)


def test_a_workers_kv_ports_are_one_range() -> None:
    fixed = KVRankConfig(options={"listen_port": 7000})
    assert [fixed.rank_options(r)["listen_port"] for r in range(2)] == [7000, 7001]
    assert [fixed.piece_port(r, 2) for r in range(2)] == [7002, 7003]  # the chart opens [7000, 7004)
    anywhere = KVRankConfig(options={"listen_port": 0})
    assert anywhere.rank_options(1)["listen_port"] == 0 and anywhere.piece_port(1, 2) == 0


def test_each_worker_gets_its_pools_gpu_count() -> None:
    plan = DevicePlan(visible=("0", "1", "2", "3", "4", "5"), prefill_per_worker=2, decode_per_worker=1)
    assert assign(plan, ["prefill", "decode", "prefill", "decode"]) == [("0", "1"), ("2",), ("3", "4"),
                                                                        ("5",)]
    explicit = DevicePlan(prefill_gpus=("0", "1"), decode_gpus=("2", "3", "4", "5"), prefill_per_worker=2,
                          decode_per_worker=4)
    assert assign(explicit, ["prefill", "decode"]) == [("0", "1"), ("2", "3", "4", "5")]
    with pytest.raises(ValueError, match="cannot give 4"):
        DevicePlan(prefill_gpus=("0", "1"), decode_gpus=("2",), decode_per_worker=4)
    with pytest.raises(ValueError, match="none visible"):
        DevicePlan(prefill_per_worker=2)


def test_cluster_launches_tp_workers_on_their_gpus() -> None:
    prefill, decode = pool_tp_args(prefill_tp=2, decode_tp=1)
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2, prefill_args=tuple(prefill),
                       decode_args=tuple(decode),
                       devices=DevicePlan(visible=("0", "1", "2", "3"), prefill_per_worker=2,
                                          decode_per_worker=1))
    _, backend = _launch(spec)
    assert backend.started == [("prefill", "prefill-1", ("0", "1"), 0), ("decode", "decode-2", ("2",), 0),
                               ("decode", "decode-3", ("3",), 0)]
    assert backend.args["prefill-1"][-2:] == ["--tensor-parallel-size", "2"]
    assert backend.args["decode-2"][-2:] == ["--kv-source-tp", "2"]
    _, ray = _launch(spec, "ray")  # under Ray: a request for the pool's GPU count (Ray picks them)
    assert [(name, gpus) for _, name, _, gpus in ray.started] == [("prefill-1", 2), ("decode-2", 1),
                                                                   ("decode-3", 1)]


@pytest.mark.timeout(120)
def test_ray_bundle_reserves_a_workers_gpus_together() -> None:
    ray = pytest.importorskip("ray")
    from pdserve.app.launcher.backends import RayBackend

    ray.init(num_cpus=1, num_gpus=3, include_dashboard=False, namespace="pdserve-test", log_to_driver=False)
    try:
        backend = RayBackend.__new__(RayBackend)  # its __init__ joins Ray; this one is already up
        backend.ray, backend._groups = ray, {}

        @ray.remote(num_cpus=0)
        def gpus() -> list:
            return ray.get_gpu_ids()

        strategy = backend.gpu_bundle("prefill-1", 2)
        got = ray.get(gpus.options(num_gpus=2, scheduling_strategy=strategy).remote(), timeout=60)
        assert len(got) == 2
        assert ray.available_resources().get("GPU", 0) == 1  # the other two are the bundle's
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(backend._groups["prefill-1"])
        assert table["strategy"] == "STRICT_PACK" and table["bundles"] == {0: {"GPU": 2.0}}
        ray.util.remove_placement_group(backend._groups.pop("prefill-1"))
    finally:
        ray.shutdown()
