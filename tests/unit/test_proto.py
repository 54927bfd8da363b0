"""The committed generated code matches proto/ (regenerate with `make proto`), and the wire contract holds."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "proto" / "pdserve" / "v1").glob("*.proto"))


def test_generated_code_is_fresh(tmp_path: pathlib.Path) -> None:
    import grpc_tools  # the locked grpcio-tools (pyproject.toml pins the version that generated the stubs)

    assert grpc_tools is not None and PROTOS, "no .proto files found"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, PROTOS)]
    subprocess.run(cmd, check=True, capture_output=True)
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "pdserve" / "v1").glob("*.py*"))
    assert len(generated) == 3 * len(PROTOS)
    stale = [str(rel) for rel in generated
             if not (ROOT / rel).exists() or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


def test_services_and_key_fields_exist() -> None:
    from pdserve.v1 import (
        common_pb2,
        decode_pb2,
        decode_pb2_grpc,
        prefill_pb2,
        prefill_pb2_grpc,
        router_pb2,
        router_pb2_grpc,
    )

    assert hasattr(router_pb2_grpc, "RouterServicer") and hasattr(router_pb2_grpc, "RouterStub")
    assert hasattr(prefill_pb2_grpc, "PrefillStub") and hasattr(decode_pb2_grpc, "DecodeStub")
    req = router_pb2.GenerateRequest(text="hi", max_tokens=3, session_id="s")
    assert req.WhichOneof("prompt") == "text"
    req2 = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert req2 == req and req2.HasField("max_tokens") and not req2.sampling.HasField("temperature")
    assert set(router_pb2.FinalInfo.DESCRIPTOR.fields_by_name) == {"finish_reason", "usage", "facts"}
    facts = common_pb2.RequestFacts.DESCRIPTOR.fields_by_name
    for name in ("prefill_worker", "decode_worker", "transport", "kv_blocks_sent", "kv_bytes_sent",
                 "kv_blocks_reused", "session_moved", "move_reason", "fallback", "fallback_reason"):
        assert name in facts, name
    # what travels is read: max_tokens rides in the sampling message, no session id goes to decode
    assert "max_tokens" in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for msg in (decode_pb2.AllocateRequest, prefill_pb2.PrefillRequest):
        assert not {"max_tokens", "session_id"} & set(msg.DESCRIPTOR.fields_by_name), msg
    assert set(prefill_pb2.PrefillResponse.DESCRIPTOR.fields_by_name) == {"first_token_id", "first_logprob",
                                                                          "first_top_logprobs", "facts"}
    stats = common_pb2.WorkerStats.DESCRIPTOR.fields_by_name
    for name in ("worker_id", "role", "incarnation", "layout_hash", "model_fingerprint", "queue_depth",
                 "num_running", "free_blocks", "total_blocks", "block_size", "transports", "kv_endpoint"):
        assert name in stats, name


def test_the_per_request_report_prints_every_fact() -> None:
    from pdserve.v1 import common_pb2, router_pb2
    from pdserve.wire import report

    facts = common_pb2.RequestFacts(decode_worker="d0", kv_bytes_sent=1 << 40, decode_ms=1.5)
    out = report(router_pb2.FinalInfo(finish_reason="length", facts=facts,
                                      usage=common_pb2.Usage(prompt_tokens=3, cached_tokens=2)))
    names = [f.name for f in common_pb2.RequestFacts.DESCRIPTOR.fields]
    assert list(out) == ["finish_reason", *names, "usage"]  # every field, zeros included
    assert out["kv_bytes_sent"] == 1 << 40 and out["decode_ms"] == 1.5 and out["decode_worker"] == "d0"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 2}


def test_the_locked_grpcio_tools_is_the_one_that_generated_the_stubs() -> None:
    from importlib import metadata

    from pdserve.v1 import router_pb2_grpc

    assert metadata.version("grpcio-tools") == router_pb2_grpc.GRPC_GENERATED_VERSION
