"""The chart's tensor-parallel pools: each pool's TP size reaches its workers, a pod requests one GPU per
rank (and refuses a contradicting count), a decode pool narrower than the prefill pool takes KV in pieces
(PDSERVE_KV_SOURCE_TP), and the TCP NetworkPolicies open the decode ranks' KV port range."""

from __future__ import annotations

from chart_helpers import by_kind, deployment, render, render_fails

CUDA = ("engine.device=cuda",)


def env(dep: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def resources(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_pools_get_their_tp_size_and_one_gpu_per_rank() -> None:
    docs = render("default", (*CUDA, "prefill.tensorParallelSize=4", "decode.tensorParallelSize=2"))
    prefill, decode = deployment(docs, "prefill"), deployment(docs, "decode")
    assert env(prefill)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "4" and "PDSERVE_KV_SOURCE_TP" not in env(prefill)
    assert env(decode)["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2" and env(decode)["PDSERVE_KV_SOURCE_TP"] == "4"
    for dep, n in ((prefill, 4), (decode, 2)):
        assert resources(dep)["requests"]["nvidia.com/gpu"] == n == resources(dep)["limits"]["nvidia.com/gpu"]
    # CPU pods request no GPU; TP 1 pools get no TP variable (the defaults render as before)
    plain = render("default", ("engine.device=cpu", "prefill.tensorParallelSize=2"))
    assert "nvidia.com/gpu" not in resources(deployment(plain, "prefill"))["limits"]
    assert "PDSERVE_TENSOR_PARALLEL_SIZE" not in env(deployment(plain, "decode"))


def test_decode_source_tp_can_be_set_and_is_only_passed_when_wider() -> None:
    docs = render("default", ("decode.tensorParallelSize=2", "decode.kvSourceTensorParallelSize=8"))
    assert env(deployment(docs, "decode"))["PDSERVE_KV_SOURCE_TP"] == "8"
    docs = render("default", ("prefill.tensorParallelSize=2", "decode.tensorParallelSize=4"))
    assert "PDSERVE_KV_SOURCE_TP" not in env(deployment(docs, "decode"))


def test_a_contradicting_gpu_count_is_refused() -> None:
    err = render_fails("gpu", ("prefill.tensorParallelSize=2",))
    assert "prefill.resources asks for 1 nvidia.com/gpu but prefill.tensorParallelSize is 2" in err


def test_tcp_network_policy_opens_the_decode_ranks_kv_ports() -> None:
    sets = ("networkPolicy.enabled=true", "kvTransport.type=tcp", "prefill.tensorParallelSize=2")
    for decode_tp, end in (("1", 50053), ("2", 50053), ("4", 50055)):
        docs = render("default", (*sets, f"decode.tensorParallelSize={decode_tp}"))
        policies = {p["metadata"]["name"]: p for p in by_kind(docs, "NetworkPolicy")}
        egress = policies["pdserve-prefill"]["spec"]["egress"][0]["ports"]
        ingress = policies["pdserve-decode"]["spec"]["ingress"][1]["ports"]
        want = {"protocol": "TCP", "port": 50052, "endPort": end}
        assert want in egress and want in ingress, (decode_tp, egress, ingress)
    docs = render("default", ("networkPolicy.enabled=true", "kvTransport.type=tcp"))
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "NetworkPolicy")}
    assert {"protocol": "TCP", "port": 50052} in policies["pdserve-prefill"]["spec"]["egress"][0]["ports"]
