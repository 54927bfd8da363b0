"""Runs one scheduled step on the device: flat batch in, sampled tokens out.

Owns the KV cache tensor, the attention backend and the sampler. Per step it builds the flat
``input_ids`` (one host->device copy), lets the backend ``plan`` the attention indices once, runs
the model over all tokens, computes logits only for the rows that sample (the last token of each
sequence whose known tokens are now all in KV; a prompt chunk that is not the last samples
nothing) and samples them. The only device->host transfer is the sampled ids (plus logprobs when a
request asked for them).

``launch`` queues a step and returns at once (a ``LaunchedStep``); its ``result()`` waits for that
step's sampled ids. ``execute`` is the two back to back. Between them the engine may launch the next
decode step, its input ids copied on the device from this one's sampled ids (``PrevTokens``), so the
host's work for step n+1 runs while the GPU computes step n (engine.step_ahead).

Rows under a structured-output constraint (engine.grammar) sample under their mask, built on the host
from their grammar's state. A launched-ahead step whose constrained row's input is still a placeholder
holds its whole sampling back (``LaunchedStep.defer``) until the engine has read the step before and
fed that token to the grammar; the forward is queued already, so the mask is built while the GPU
computes it, and unconstrained rows lose nothing but the sampling's place in the stream.

A request running its final prompt chunk with a layer sink (``engine.layer_sink``) makes the step
eager with an ``after_layer`` hook that reports each layer's KV as written; steps without one pass
no hook at all.

Tensor parallelism (``tp``): rank 0's runner broadcasts each step's plan (``engine.tp_plan``)
before its forward; the other ranks' runners execute the same plan through ``follow`` and join
the forward's all-reduces and the logits gather, then drop the logits (rank 0 samples).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine import compile_key
from engine.attention import BatchSpec, backend_geometry, get_backend
from engine.grammar.masks import MaskBuilder
from engine.kv_layout import KVLayout
from engine.layer_sink import LAUNCH_THROTTLE_MIN_TOKENS, chain, launch_throttle, layer_callback
from engine.model import CausalLM
from engine.penalties import state_for
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq
from engine.staging import to_device
from engine.tp_plan import FLAG_GRAPH, FLAG_TOKENS, StepPlan, send_step
from pdserve.process_stats import BOOT


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a generated token, with the top alternatives when requested."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PrevTokens:
    """Input rows ``dst`` of a step take the tokens at rows ``src`` of ``tokens``, the device tensor of
    sampled ids of the step launched before it (``LaunchedStep.token_ids``)."""

    tokens: torch.Tensor
    dst: list[int]
    src: list[int]

    def patch(self, ids: torch.Tensor) -> None:
        """Write the rows into ``ids`` (a step's input ids on the device), on the current stream."""
        n = len(self.dst)
        if self.dst == self.src == list(range(n)):  # the common case: the same batch, in order
            ids[:n].copy_(self.tokens[:n])
            return
        dst = to_device(torch.tensor(self.dst, dtype=torch.int64), ids.device)
        src = to_device(torch.tensor(self.src, dtype=torch.int64), ids.device)
        ids.index_copy_(0, dst, self.tokens.index_select(0, src))


class LaunchedStep:
    """One step queued on the device. ``token_ids`` are its sampled ids on the device (a later launch
    may take its input from them); ``result()`` waits for the step and reads them, with the logprob
    entries, on the host. Sampled values are copied into pinned host buffers as part of the launch,
    and an event marks them, so ``result()`` waits for this step only, not for one queued after it."""

    def __init__(self, runner: ModelRunner, samplers: list[ScheduledSeq], *, num_tokens: int,
                 t0: float) -> None:
        self._runner = runner
        self._samplers = samplers
        self._num_tokens = num_tokens
        self._t0 = t0
        self.launched_at = t0
        self.token_ids: torch.Tensor | None = None
        self._host: list[torch.Tensor | None] = []
        self._done: torch.cuda.Event | None = None
        self._deferred: Callable[[], None] | None = None

    def defer(self, sample: Callable[[], None]) -> None:
        """Hold back the sampling: a constrained row's input is a placeholder for the token of the step
        launched before this one, and its mask needs that token. The forward is queued; ``finish``
        samples once the engine has read the step before (engine.step_ahead), while the GPU still
        computes this one's forward."""
        self._deferred = sample

    def finish(self) -> None:
        """Queue a held-back sampling (``defer``); a no-op otherwise."""
        if self._deferred is not None:
            sample, self._deferred = self._deferred, None
            sample()

    def take(self, out) -> None:
        self.token_ids = out.token_ids
        parts = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
        if out.token_ids.device.type == "cpu":
            self._host = parts
            return
        self._host = [None if t is None else _to_host(t) for t in parts]
        # blocking: the wait in result() sleeps instead of spinning a core (EngineConfig.gpu_wait)
        self._done = torch.cuda.Event(blocking=self._runner.blocking_wait)
        self._done.record()

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        t1 = time.monotonic()
        phases = {"tokens": self._num_tokens, "launch_ms": round((self.launched_at - self._t0) * 1e3, 1)}
        if not self._samplers:
            self._runner.last_phases = phases
            return [], []
        self.finish()
        if self._done is not None:
            self._done.synchronize()
        tokens_t, lps_t, top_ids_t, top_lps_t = self._host
        tokens = tokens_t.tolist()
        # Host time of the step's parts (pdserve.stall_watch reports them with a GIL stall): plan and
        # launch of the forward and the sampling, then the wait for the sampled tokens.
        phases["sync_ms"] = round((time.monotonic() - t1) * 1e3, 1)
        self._runner.last_phases = phases
        if lps_t is None:
            return tokens, [None] * len(tokens)
        lps = lps_t.tolist()
        top_ids = top_ids_t.tolist() if top_ids_t is not None else None
        top_lps = top_lps_t.tolist() if top_lps_t is not None else None
        entries: list[TokenLogprob | None] = []
        for i, s in enumerate(self._samplers):
            n = s.seq.params.logprobs
            if n is None:
                entries.append(None)
                continue
            top = tuple(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if n and top_ids else ()
            entries.append(TokenLogprob(token_id=tokens[i], logprob=lps[i], top=top))
        return tokens, entries


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVLayout, num_blocks: int, *, device: torch.device,
                 attention_backend: str = "auto", seed: int | None = None, launch_ahead_layers: int = 0,
                 blocking_wait: bool = False) -> None:
        """``layout``: this rank's KV (its heads only under tensor parallelism)."""
        cfg = model.config
        self.tp = model.tp
        model.fuse_projections()
        self.model = model
        self.device = device
        self.layout = layout
        self.last_phases: dict = {}  # the last step's host timings (execute; pdserve.stall_watch)
        self.launch_ahead_layers = launch_ahead_layers if device.type == "cuda" else 0
        self.blocking_wait = blocking_wait  # the token wait sleeps, not spins (EngineConfig.gpu_wait)
        with BOOT.phase("kv_cache_alloc"):
            self.kv_cache = layout.allocate(num_blocks, device=device)
        geometry = backend_geometry(cfg, block_size=layout.block_size)
        if model.shard is not None:
            geometry.update(num_heads=model.shard.local_heads, num_kv_heads=model.shard.local_kv_heads)
        self.backend = get_backend(attention_backend, device=device, dtype=layout.torch_dtype, **geometry)
        self.sampler = Sampler(device, seed=seed)
        self.masks = MaskBuilder(cfg.vocab_size, device)  # structured output's token masks (engine.grammar)
        self.cuda_graphs = None  # engine.cuda_graphs.DecodeGraphRunner once enable_cuda_graphs() captured
        self._staged: torch.cuda.Event | None = None  # the last launch's copies queued (_mark_staged)
        self._fed: torch.Tensor | None = None  # a follower rank: rank 0's last shared sampled ids
        compile_key.join()  # Triton's compiler key, hashed since the start, before any step launches

    def enable_cuda_graphs(self, *, max_batch: int, max_model_len: int) -> None:
        """Capture decode CUDA graphs when the backend can be captured on CUDA (see engine.cuda_graphs).
        Under tensor parallelism no bucket is captured while idle: every rank captures in the same step."""
        from engine.cuda_graphs import maybe_runner

        if self.tp is not None and not tp_graphs():  # every rank runs eager steps
            return
        self.cuda_graphs = maybe_runner(self.model, self.backend, self.kv_cache, max_batch=max_batch,
                                        max_model_len=max_model_len, when_idle=self.tp is None)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def _layer_hook(self, batch: list[ScheduledSeq]):
        """``after_layer`` for the sinks of requests running their final prompt chunk (each learns its
        block table first), or None -- no callback at all -- when the step has none."""
        sinks = [s.seq for s in batch if s.seq.layer_sink is not None and s.samples]
        if not sinks:
            return None
        for seq in sinks:
            seq.layer_sink.begin(list(seq.block_table))
        return layer_callback([seq.layer_sink for seq in sinks], self.device, blocking=self.blocking_wait)

    def execute(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Run ``batch``; returns the sampled token (and logprob entry) of each sampling row, in order."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], prev: PrevTokens | None = None, *,
               feeds_next: bool = False) -> LaunchedStep:
        """Queue ``batch``'s forward and sampling on the device and return without waiting for them;
        ``result()`` of the returned step reads its tokens. ``prev``: rows whose input token is a token
        the step launched before this one sampled, still on the device (engine.step_ahead); their host
        ids are placeholders. ``feeds_next``: the next step may take its input from this one's sampled
        ids (under tensor parallelism every rank then receives them, ``engine.tp_plan``)."""
        self._wait_staged()
        input_ids: list[int] = []
        for s in batch:
            input_ids.extend(s.seq.tokens[s.context_len:s.context_len + s.num_tokens])
        if prev is not None:
            for row in prev.dst:
                input_ids[row] = 0
        spec = BatchSpec(query_lens=[s.num_tokens for s in batch],
                         context_lens=[s.context_len for s in batch],
                         block_tables=[s.seq.block_table for s in batch])
        after_layer = self._layer_hook(batch)
        ends = np.cumsum(spec.query_lens) - 1
        rows = [int(ends[i]) for i, s in enumerate(batch) if s.samples]
        replay = after_layer is None and self.cuda_graphs is not None and self.cuda_graphs.can_run(spec)
        sent = None
        if self.tp is not None:  # the other ranks replay their graph exactly when this one does
            flags = (FLAG_GRAPH if replay else 0) | (FLAG_TOKENS if feeds_next and rows else 0)
            fed = {"fed_dst": prev.dst, "fed_src": prev.src} if prev is not None else {}
            sent = send_step(self.tp, StepPlan(input_ids=input_ids, spec=spec, rows=rows, flags=flags, **fed))
        t0 = time.monotonic()
        throttle = launch_throttle(self.launch_ahead_layers) if self.throttles(len(input_ids)) else None
        hook = chain(after_layer, throttle)
        patch = prev.patch if prev is not None else None
        if replay:
            graph = self.cuda_graphs.stage(input_ids, spec, patch)
            self._mark_staged()
            hidden = self.cuda_graphs.replay(graph, spec.num_seqs)  # [n, hidden]
        else:
            meta = self.backend.plan(spec)
            ids = self._to_device(input_ids)
            if patch is not None:
                patch(ids)
            self._mark_staged()
            # eager; a graph carries no hook: a 1-token final chunk must report its layers too
            hidden = self.model(ids, meta.positions, self.kv_cache, meta,
                                **({"after_layer": hook} if hook is not None else {}))
        if sent is not None:  # posted before this rank's own planning and launch (engine.tp_plan)
            sent.wait()
        samplers = [s for s in batch if s.samples]
        step = LaunchedStep(self, samplers, num_tokens=len(input_ids), t0=t0)
        if samplers:
            logits = self.model.compute_logits(self._rows(hidden, rows))
            sample = functools.partial(self._sample, step, logits, samplers, feeds_next)
            if any(s.seq.grammar is not None and s.seq.pending_slot is not None for s in samplers):
                step.defer(sample)  # a constrained row's mask needs the token the step before samples
            else:
                sample()
        step.launched_at = time.monotonic()
        return step

    @torch.inference_mode()
    def _sample(self, step: LaunchedStep, logits: torch.Tensor, samplers: list[ScheduledSeq],
                feeds_next: bool) -> None:
        """Sample ``step``'s rows from ``logits``: each constrained row under its grammar's mask."""
        vocab = self.model.config.vocab_size
        constrained = [i for i, s in enumerate(samplers) if s.seq.grammar is not None]
        masks = None
        if constrained:
            states = [samplers[i].seq.grammar for i in constrained]
            masks = (constrained, self.masks.build(states), self.masks)
        out = self.sampler(logits, [s.seq.params for s in samplers], [s.seq.generator for s in samplers],
                           [state_for(s.seq, vocab, self.device) for s in samplers], masks=masks)
        if feeds_next and self.tp is not None:
            self.tp.broadcast(out.token_ids)  # the other ranks' input for the next step
        step.take(out)

    def throttles(self, num_tokens: int) -> bool:
        """Whether an eager step of ``num_tokens`` tokens is launched at most ``launch_ahead_layers``
        layers ahead of the GPU (engine.layer_sink.launch_throttle): its launch returns only when the
        GPU is nearly through it."""
        return bool(self.launch_ahead_layers) and num_tokens >= LAUNCH_THROTTLE_MIN_TOKENS

    def _wait_staged(self) -> None:
        if self._staged is not None:  # the last launch's host->device copies have left its staging
            self._staged.synchronize()

    def _mark_staged(self) -> None:
        """Record that this step's host->device copies are queued. The pinned staging they read (the
        graphs' static inputs, flashinfer's page-locked plan buffers) is written again by the next
        launch, which waits for this event first: with a step launched ahead, nothing else orders it."""
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if len(rows) == hidden.shape[0]:
            return hidden  # pure decode step: every token samples
        return hidden.index_select(0, self._to_device(rows))

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A non-zero rank's share of rank 0's step: the same forward (a replay of the same bucket's graph
        when rank 0 replays one: their all-reduces must match in size), then the logits gather, then
        (``FLAG_TOKENS``) rank 0's sampled ids, kept for the next plan's ``fed_dst`` rows."""
        self._wait_staged()
        patch = None
        if plan.fed_dst:
            if self._fed is None:
                raise RuntimeError("rank 0 feeds this step from sampled ids this rank never received")
            patch = PrevTokens(tokens=self._fed, dst=list(plan.fed_dst), src=list(plan.fed_src)).patch
        if plan.flags & FLAG_GRAPH:
            if self.cuda_graphs is None:
                raise RuntimeError("rank 0 replays a decode CUDA graph but this rank captured none "
                                   "(PDSERVE_TP_CUDA_GRAPHS / PDSERVE_CUDA_GRAPHS differ between ranks?)")
            graph = self.cuda_graphs.stage(plan.input_ids, plan.spec, patch)
            self._mark_staged()
            hidden = self.cuda_graphs.replay(graph, plan.spec.num_seqs)
        else:
            meta = self.backend.plan(plan.spec)
            ids = self._to_device(plan.input_ids)
            if patch is not None:
                patch(ids)
            self._mark_staged()
            hidden = self.model(ids, meta.positions, self.kv_cache, meta)
        if plan.rows:
            self.model.compute_logits(self._rows(hidden, plan.rows))
        if plan.flags & FLAG_TOKENS:
            self._fed = self.tp.broadcast(torch.empty(len(plan.rows), dtype=torch.int64, device=self.device))


def tp_graphs() -> bool:
    """Decode CUDA graphs at tensor parallel size > 1 (on by default; ``PDSERVE_TP_CUDA_GRAPHS=0`` turns
    them off): every rank captures the same buckets in the same order at start-up (each capture's forward
    carries the ranks' all-reduces) and replays a bucket in the same step (``FLAG_GRAPH``), so the NCCL
    all-reduces recorded in the graphs pair up. Eager TP decode of the 8B shape on 2x H200 took 45 ms a
    step at batch 1 against 5.75 ms with graphs (docs/tensor-parallel.md)."""
    from pdserve.settings import env_switch

    return env_switch("PDSERVE_TP_CUDA_GRAPHS", True)
