"""Names vulture (``make lint``) cannot see used: set for a library or a framework that reads them.

Each line "uses" one name; keep a comment saying who reads it. Everything else vulture reports is
dead code to delete, not to list here.
"""
# ruff: noqa: B018, F821

_.pre_tokenizer  # tokenizers.Tokenizer reads it (engine/checkpoint.py builds the BPE tokenizer)
_.post_processor  # same
_._timeout  # torch.distributed options structs (engine/tp_group.py)
_.rootRank  # same
_.reduceOp  # same: read by the c10d collective it is handed to
_.__cuda_array_interface__  # torch.as_tensor reads it (engine/early_upload.py hands device bytes to torch)
_.num_prefill_tokens  # FlashInferMetadata field, kept for repr/debugging of a step's plan
_.generated_tokens  # engine counters, exported whole (dataclasses.asdict) in stats
_.decode_cached  # scoring record field, shown in the placement's path report
_.best_of  # OpenAI request fields: parsed so they can be refused by name (router/http)
_.description  # tool definitions: handed whole to the chat template (model_dump, router/http/frontend.py)
_.strict  # OpenAI request fields accepted and not acted on (router/http/schemas.py)
_.parallel_tool_calls
_.allocate_ms  # protobuf message fields set by the pipeline (read by the client)
_.prefill_mode_reason
_.prefill_worker
_.prefill_rpc_ms
_.Export  # the OTLP TraceService method a test receiver serves (grpc calls it by name)
_.decode_tier_tokens
_.predicted_decode_blocks
_.new_pid  # soak fault records, written out whole as JSON (bench/soak_faults.py)
_.exit_note
_._greedy  # soak traffic kinds, dispatched by name (bench/soak_traffic.py)
_._seeded
_._deadline
_._bad
_._session
_.exitstatus  # pytest hook signature
_.torch_single_thread  # pytest fixture requested by name
_.decode_replicas  # e2e target records
_.watches  # fake Kubernetes API server state read by its handler
__getattr__  # module-level: Python calls it for a missing name (kvtransfer/__init__.py, PEP 562 lazy imports)
_.held_s  # soak Fault field, read from dataclasses.asdict in the report
_.guided_decoding_backend  # OpenAI door: vLLM's field, accepted and ignored (one grammar engine)
