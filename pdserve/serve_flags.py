"""The ``pdserve serve`` flags: their declaration and help texts, one per ``ServeSettings`` field.

Every flag is declared with ``default=None`` so that "not given" is visible; ``ServeSettings.from_args``
(pdserve/settings.py) then fills in ``PDSERVE_<FLAG>`` from the environment and the defaults and
validates the whole. The choices come from settings.py, which owns the values.
"""

from __future__ import annotations

import argparse

from pdserve.settings import (
    ADMISSION_DRAIN,
    CONDITIONAL,
    DEVICES,
    DISCOVERY,
    DTYPES,
    EVENT_LOOPS,
    GPU_WAITS,
    ON_OFF,
    POLICIES,
    ROLES,
    ROUTER_MODES,
    TOOL_CALL_PARSERS,
    TRANSPORTS,
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every serve flag; defaults stay None so ServeSettings.from_args can apply env vars."""
    a = parser.add_argument
    a("--role", choices=ROLES, help="which service this process runs")
    a("--model", help="model directory (HF config.json + safetensors + tokenizer.json)")
    a("--host", help="bind address (default 0.0.0.0)")
    a("--port", type=int, help="gRPC port (default 50051; 0 = pick a free one)")
    a("--metrics-port", type=int, help="Prometheus /metrics port (0 = off)")
    a("--http-port", type=int, help="router: OpenAI-compatible HTTP API port on --host (0 = off, default)")
    a("--served-model-name", help="router: the model name the HTTP API answers to (default: the model "
      "directory's name)")
    a("--tool-call-parser", choices=TOOL_CALL_PARSERS,
      help="router: how the HTTP API reads tool calls in chat answers: hermes (<tool_call> JSON, Qwen2.5 "
      "and Hermes), llama3_json (Llama 3.1+ JSON calls), none, or auto (default: from the chat template)")
    a("--api-key", action="append", help="router: a key clients must send (authorization: Bearer KEY) on "
      "gRPC and HTTP; repeatable; PDSERVE_API_KEY takes a comma-separated list")
    a("--api-keys-file", help="router: file of accepted keys, one a line, re-read when it changes")
    a("--advertise-host", help="the host others should dial (default: this host's IP)")
    a("--worker-id", help="stable worker id (default generated)")
    a("--dtype", choices=DTYPES)
    a("--device", choices=DEVICES)
    a("--block-size", type=int, help="tokens per KV block (default 16)")
    a("--num-blocks", type=int, help="KV blocks to allocate")
    a("--kv-memory-gb", type=float, help="KV cache size in GiB (instead of --num-blocks)")
    a("--kv-host-gb", type=float, help="worker roles: host-memory KV tier in GiB, where blocks evicted from "
      "the device cache wait to be reused (pinned; 0: off; default on CUDA twice the device cache, at most a "
      "quarter of the host's available memory; off on CPU, whose cache is host memory already)")
    a("--kv-disk-dir", help="worker roles: local-disk KV tier in this directory (with --kv-disk-gb): the "
      "host tier's evictions, kept across restarts for the same model and KV layout")
    a("--kv-disk-gb", type=float, help="size of the disk KV tier in GiB (with --kv-disk-dir)")
    a("--otlp-endpoint", help="trace requests: send spans to this OTLP/gRPC receiver (HOST:PORT or "
      "http://HOST:PORT of an OpenTelemetry collector); default off")
    a("--otlp-sampling", type=float, help="the share of new traces sampled, 0..1 (default 1; a client's "
      "sampled traceparent is always followed)")
    a("--max-num-seqs", type=int, help="max sequences in the running batch")
    a("--max-num-batched-tokens", type=int, help="chunked-prefill token budget per step")
    a("--stream-interval", type=int, help="decode/colocated: send generated tokens N at a time (a "
      "stream's first and last message go at once): N times fewer messages for the router to relay, "
      "delivered in bursts of N (default 1)")
    a("--launch-ahead-layers", type=int,
      help="CUDA: how many layers a large step may launch ahead of the GPU (0: no limit; default 4)")
    a("--gpu-wait", choices=GPU_WAITS, help="CUDA: how the engine waits for the GPU: blocking (sleeps), "
      "spin (polls: a core busy per worker while the GPU computes) or auto (default: blocking where decode "
      "steps are launched ahead, spin where they are synchronous, as under tensor parallelism)")
    a("--event-loop", choices=EVENT_LOOPS, help="the process's asyncio event loop: uvloop, asyncio's own, "
      "or auto (default: uvloop where it is installed)")
    a("--tensor-parallel-size", type=int, help="worker roles: processes (GPUs) per worker, one tensor "
      "parallel rank each (default 1)")
    a("--kv-source-tp", type=int, help="decode: the prefill pool's tensor parallel size when it is larger "
      "than this worker's: each rank then takes its KV heads in pieces from several prefill ranks and "
      "regroups them (default: this worker's size; smaller senders always work)")
    a("--kv-staging-blocks", type=int, help="prefill: staging area per rank (in KV blocks) for decode "
      "workers holding fewer KV heads per rank than this one (default: a quarter of the cache)")
    a("--transport", choices=TRANSPORTS, help="KV transport (default auto: nixl if usable, else tcp)")
    a("--kv-port", type=int, help="KV side-channel / TCP data port (0 = pick free)")
    a("--kv-host", help="bind address of every KV listener (side channel, TCP data, NIXL/UCX; default "
      "--host)")
    a("--kv-connections", type=int, help="TCP KV transport: connections per decode worker (default 8)")
    a("--kv-stripe", choices=ON_OFF, help="TCP KV transport: spread one transfer's frames over all the "
      "connections (default on: a lone 2k-token transfer ~3x faster on 2x H200; off: one connection per "
      "transfer, fewer receive threads busy at once beside decode)")
    a("--kv-rx-chain", choices=ON_OFF, help="TCP KV transport, receiving: a receive thread that finished a "
      "frame also takes the next frame's head off the socket when it is there, so the event loop spends "
      "one turn per frame, not three (default on)")
    a("--kv-staging", choices=("gather", "runs"), help="TCP KV transport from GPU memory: stage a frame's "
      "scattered block runs with one gather on the GPU and one copy (receiving: one copy, one scatter), or "
      "one copy per run (default gather: a constant number of CUDA calls per frame, each a GIL hand-off)")
    a("--kv-own-loop", choices=ON_OFF, help="decode: receive KV on an event loop of its own thread instead "
      "of the gRPC streams' loop (default off: on 2x H200 a third thread contending for the GIL cost more "
      "than the loop turns it saved)")
    a("--kv-tls-procs", type=int, help="TCP KV transport with TLS: helper processes doing the TLS record "
      "work (each has a GIL of its own; default a quarter of the cores, 1..8; 0 = in the worker)")
    a("--kv-stream-layers", choices=ON_OFF, help="prefill: push each layer's KV while the next layer "
      "computes (default on; off = one send after the prefill)")
    a("--drain-timeout", type=float, help="seconds to finish in-flight requests on SIGTERM (default 30)")
    a("--lease-ms", type=int, help="decode: release a reservation whose KV never arrives (default 30000)")
    a("--discovery", choices=DISCOVERY, help="router: how to find workers (default static)")
    a("--prefill", help="router, static discovery: prefill addresses, comma separated")
    a("--decode", help="router, static discovery: decode addresses, comma separated")
    a("--redis", help="Redis URL (router state / worker registration)")
    a("--k8s-namespace")
    a("--prefill-selector", help="router, k8s discovery: label selector of prefill pods")
    a("--decode-selector", help="router, k8s discovery: label selector of decode pods")
    a("--policy", choices=POLICIES, help="router placement policy (default prefix: a request with a session "
      "id goes to its session's pair while that pair is usable, any other by prefix overlap and load; "
      "prefix_only ignores session ids)")
    a("--workers-file", help="router, discovery file: JSON {\"prefill\": [..], \"decode\": [..]}, watched")
    a("--session-ttl", type=float, help="router: seconds a session's affinity is kept (default 600)")
    a("--stats-interval", type=float, help="router: seconds between worker GetStats polls (default 0.5)")
    a("--mode", choices=ROUTER_MODES, help="router: disagg (prefill + decode pools, default) or colocated "
      "(--decode lists colocated workers; each prefills what it decodes)")
    a("--conditional-disagg", choices=CONDITIONAL, help="router: auto = the decode worker prefills locally "
      "when the uncached suffix is short or the KV transfer would be slower than recomputing (default off)")
    a("--min-uncached-tokens", type=int, help="router, conditional: at or below this many uncached prompt "
      "tokens prefill locally (default 256)")
    a("--local-prefill-tokens-per-s", type=float, help="router: every worker's prefill rate in the "
      "router's cost model until that worker's own is measured (placement and conditional "
      "disaggregation; default 30000, a GPU figure)")
    a("--max-prefill-wait-s", type=float, help="router, conditional: prefill locally when the prefill "
      "worker's estimated queue is longer than this many seconds (default 0.5; 0 = never for that reason)")
    a("--local-prefill-duty", type=float, help="router, conditional: at most this share of a decode "
      "worker's time goes to local prefills (default 0.25; 1 = no limit)")
    a("--local-prefill-burst-s", type=float, help="router, conditional: at most this many seconds of local "
      "prefill back to back on one decode worker (default 0.25)")
    a("--local-prefill-max-stall-s", type=float, help="router, conditional: while a decode worker runs "
      "streams, no single local prefill costing more than this many seconds (each running stream waits for "
      "it; default 0.05)")
    a("--local-prefill-stall-weight", type=float, help="router, conditional: a prompt spills off a busy "
      "prefill queue only if the TTFT it saves exceeds this x the delay it adds to the decode worker's "
      "streams, summed (default 1; 0 = not weighed)")
    a("--store-timeout", type=float, help="router: seconds one Redis call may take on the placement path "
      "before the local view decides (default 0.05)")
    a("--max-queue-wait-s", type=float, help="router: refuse at once (RESOURCE_EXHAUSTED with a "
      "retry-after-ms hint) a request that would wait longer than this to start (default 0: only its "
      "deadline)")
    a("--admission-drain", choices=ADMISSION_DRAIN, help="router: the wait estimate is at least the "
      "tokens ahead at the prefill worker over the rate its answers recently came, whatever held them up "
      "(compute, KV link, receiver) (on, the default); replace: that instead of the compute queue plus the "
      "push wait when larger; off: compute queue plus push wait only")
    a("--decode-mux", choices=ON_OFF, help="router: every Allocate and Decode stream to a decode worker "
      "on one long-lived DecodeMany call, each response carrying every stream's tokens of an engine step "
      "(on, the default); off: an Allocate and a Decode call per request (a worker without DecodeMany "
      "gets that anyway)")
    a("--allocate-queue-size", type=int, help="router: decode Allocates that may wait for free KV blocks, "
      "per decode worker (default 64; 0 = refuse at once)")
    a("--allocate-queue-wait-s", type=float, help="router: the longest a decode Allocate waits for free "
      "blocks (default 10; 0 = the worker's answer stands)")
    a("--max-request-bytes", type=int, help="router / colocated: largest request accepted on the public port "
      "(bytes, default 16 MiB); a larger one is refused with RESOURCE_EXHAUSTED before any work")
    a("--tls-dir", help="TLS from this directory (`pdserve certs init DIR`): the router's port over TLS, "
      "mutual TLS on every worker port and from the router to the workers (default: plaintext)")
    a("--migration", choices=ON_OFF, help="router: continue a request on another worker when its worker "
      "dies, token-exact (default on)")
    a("--max-request-retries", type=int, help="router: attempts per request that may fail on a worker "
      "before the client gets UNAVAILABLE (default 3)")
    a("--retry-wait-s", type=float, help="router: seconds a request may wait for a usable worker while "
      "none is left (a restart) (default 30)")
