"""``LLMEngine``: requests in, tokens out, one ``step()`` (one forward pass) at a time.

The engine is single-threaded; callers (``engine.async_engine``, the services, the CLI) add
requests and call ``step()`` in a loop while ``has_unfinished()``. Each step the scheduler picks a
batch (decodes, prompt chunks, admissions; see ``engine.scheduler``), the model runner computes it,
and every request that got a token — or finished for another reason (stop, length, abort,
rejection) — gets one ``StepOutput``.

Disaggregation hooks (see docs/engine-contract.md): ``add_prefill_request`` runs a prompt and pins
its KV for the caller ("prefilled"); ``reserve`` / ``commit_prefilled`` take blocks for a prompt
whose KV another worker writes, then decode from the first token it sampled; ``release`` drops a
pinned or reserved request at any stage. Finished requests' full blocks stay in the prefix cache.

Tensor parallelism: ``LLMEngine(config, tp=group)`` is rank 0 of a worker whose other ranks are
``engine.tp_worker.TPFollower``s; ``kv_layout`` stays the whole model's, ``rank_kv_layout`` is
this rank's heads, and ``close()`` releases the followers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.cuda_graphs import capture_next_idle
from engine.engine_types import EngineConfig, Reservation, StepOutput
from engine.errors import DuplicateRequest, KVCacheFull, QueueFull, UnknownRequest
from engine.grammar import GrammarCompiler
from engine.kv_events import KVEvents
from engine.kv_layout import KVLayout, dtype_name
from engine.kv_tiers.tiers import KVTiers, attach_tiers, cache_snapshot
from engine.layer_sink import LayerSink
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.request_checks import checked_prompt
from engine.sampler import advance_generator, make_generator
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, Status
from engine.step_ahead import InFlight, LaunchAhead, goes_ahead, overlap_by_default
from engine.step_histograms import StepHistograms
from engine.stopping import append_token
from engine.tp_group import TPGroup
from engine.tp_plan import send_stop
from engine.tp_worker import agree_num_blocks, load_model, model_fingerprint, rank_layout
from engine.tp_worker import resolve_device as _resolve_device
from pdserve.sampling import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "Reservation", "StepOutput"]

log = logging.getLogger(__name__)


@dataclass
class _Counters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps_ahead: int = 0  # of ``steps``, those launched before the previous step's tokens were read
    finish_reasons: dict = field(default_factory=dict)


class LLMEngine(LaunchAhead):
    def __init__(self, config: EngineConfig, *, model: CausalLM | None = None, tokenizer=None,
                 tp: TPGroup | None = None) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.tp = tp
        if tp is not None and tp.rank != 0:
            raise ValueError("LLMEngine is rank 0 of a tensor parallel group; other ranks run TPFollower")
        if model is None:
            if config.model is None:
                raise ValueError("EngineConfig.model (a model directory) is required without model=")
            model, tokenizer = load_model(config, self.device, tp)
        else:
            model = model.to(self.device, dtype=_dtype(config.dtype) or next(model.parameters()).dtype)
        if model.tp is not tp:
            raise ValueError("model= must be built with the engine's TPGroup (build_model(tp=...))")
        self.model = model.eval()
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        dtype = next(model.parameters()).dtype
        cfg = self.model_config
        self.kv_layout = KVLayout.for_model(cfg, block_size=config.block_size, dtype=dtype,
                                            memory=self.device.type,
                                            model_fingerprint=model_fingerprint(model))
        self.rank_kv_layout = rank_layout(self.kv_layout, model)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        mine = config.kv_blocks(self.rank_kv_layout.cache_bytes(1), self.device, self.max_model_len)
        num_blocks = mine if tp is None else agree_num_blocks(tp, mine)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_prefix_caching=config.enable_prefix_caching)
        self.runner = ModelRunner(model, self.rank_kv_layout, num_blocks, device=self.device,
                                  attention_backend=config.attention_backend, seed=config.seed,
                                  launch_ahead_layers=config.launch_ahead_layers)
        if config.cuda_graphs:
            self.runner.enable_cuda_graphs(max_batch=config.max_num_seqs, max_model_len=self.max_model_len)
        self.kv_events = KVEvents()  # what the cache gains and loses, by tier, for the router
        self.block_manager.events = self.kv_events
        self.tiers: KVTiers | None = attach_tiers(config.tiers, self, tp=tp)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        # structured output: compiled grammars, cached (engine.grammar; compiled off this thread first)
        self.grammars = GrammarCompiler(tokenizer, vocab_size=cfg.vocab_size,
                                        eos_token_ids=self.eos_token_ids)
        self._requests: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []  # outputs decided outside step() (abort, commit)
        self._inflight: InFlight | None = None  # a decode step launched, tokens not read (step_ahead)
        self.overlap_steps = overlap_by_default(config.overlap_steps, self.device, tp)
        self.runner.blocking_wait = config.blocking_wait(self.overlap_steps)
        self._arrivals = 0
        self.stats = _Counters()
        self.step_histograms = StepHistograms()  # exported by the worker's metrics at scrape time
        self._closed = False
        log.info("engine ready: %s on %s, %d KV blocks (%s), backend %s, steps %s, GPU waits %s",
                 cfg.architecture, self.device, num_blocks, self.kv_layout.describe(),
                 self.runner.backend.name, "launched ahead" if self.overlap_steps else "synchronous",
                 "blocking" if self.runner.blocking_wait else "spinning")

    # ---- properties ---------------------------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work() or self._inflight is not None

    # ---- idle work ----------------------------------------------------------------------------
    def has_idle_work(self) -> bool:
        """Whether ``idle_work`` has something to do: decode CUDA graphs not captured yet."""
        graphs = self.runner.cuda_graphs
        return graphs is not None and graphs.idle_pending()

    def idle_work(self) -> bool:
        """One piece of start-up work deferred past SERVING (the largest decode CUDA graph not captured
        yet; ``engine.cuda_graphs.capture_next_idle``), for a driver to run only while
        ``has_unfinished()`` is False (``engine.async_engine``). False when it did nothing."""
        return capture_next_idle(self.runner.cuda_graphs, self.block_manager)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Seq[int],
                    params: SamplingParams | None = None) -> None:
        """Queue a full generation; raises RequestTooLong, QueueFull, DuplicateRequest or ValueError."""
        self._enqueue(self._new_sequence(request_id, prompt_ids, params or SamplingParams()))

    def add_prefill_request(self, request_id: str, prompt_ids: Seq[int],
                            params: SamplingParams | None = None, *, layer_sink: LayerSink | None = None,
                            ) -> None:
        """Run only the prompt; emits the first token with ``finish_reason="prefilled"`` and keeps the
        KV blocks pinned (``block_table``) until ``release``. ``layer_sink`` is told, layer by layer,
        when the final prompt chunk's KV is written (``engine.layer_sink``)."""
        seq = self._new_sequence(request_id, prompt_ids, params or SamplingParams(), prefill_only=True)
        seq.layer_sink = layer_sink
        self._enqueue(seq)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_table)

    def reserve(self, request_id: str, prompt_ids: Seq[int],
                params: SamplingParams | None = None) -> Reservation:
        """Blocks for a prompt whose KV someone else writes; reuses locally cached full blocks."""
        seq = self._new_sequence(request_id, prompt_ids, params or SamplingParams())
        if not self.scheduler.reserve(seq):
            need = self.scheduler.blocks_for(seq.num_tokens)
            raise KVCacheFull(f"cannot reserve {need} KV blocks for request {request_id!r}: "
                              f"{self.num_free_blocks} of {self.num_total_blocks} free")
        self._requests[request_id] = seq
        return Reservation(block_ids=list(seq.block_table), num_tier_tokens=seq.tier_planned,
                           num_cached_tokens=seq.num_computed + seq.tier_planned)

    def commit_prefilled(self, request_id: str, first_token_id: int) -> None:
        """The reserved request's prompt KV is written: decode on from ``first_token_id``."""
        seq = self._get(request_id)
        if seq.status is not Status.RESERVED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not reserved")
        if not 0 <= int(first_token_id) < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token_id} is outside the vocabulary")
        self.scheduler.commit_reserved(seq)
        if seq.generator is not None:  # the prefill worker drew the first token from this seed
            advance_generator(seq.generator, self.model_config.vocab_size)
        self._append(seq, int(first_token_id))
        if seq.finish_reason is not None:
            self._pending.append(self._finish(seq, []))

    def abort(self, request_id: str) -> bool:
        """Stop a request at any stage; a queued or running one gets a final "abort" output."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        _abort_sink(seq, "aborted")
        live = seq.status in (Status.WAITING, Status.RUNNING)
        self._remove(seq)
        if live:
            seq.finish_reason = "abort"
            self._pending.append(self._output(seq, [], None))
        return True

    def release(self, request_id: str) -> None:
        """Drop a request (pinned, reserved, or anything else) and its blocks; idempotent."""
        self.abort(request_id)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step: a synchronous forward, or (decode steps launched ahead, engine.step_ahead) the next
        step's launch and the tokens of the one in flight. Outputs of a launched step come from the
        ``step()`` after the one that launched it."""
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            flight, self._inflight = self._inflight, None
            self._inflight = self._launch_ahead(flight)
            outputs += self._read(flight)
            if self._inflight is not None:  # its constrained rows' masks follow the tokens just read
                self._inflight.launched.finish()
            outputs += self._pending
            self._pending = []
            return outputs
        sched = self.scheduler.schedule()
        outputs += self._rejected(sched)
        if not sched.scheduled:
            if self.tiers is not None and not outputs and self.scheduler.loading():
                self.tiers.wait_any(timeout=0.002)  # only tier loads to wait for: no busy loop
            return outputs
        self.stats.preemptions += sched.num_preempted
        if self.overlap_steps and goes_ahead(sched.scheduled):
            self._inflight = self._launch(sched.scheduled, None)
            return outputs
        prompt_tokens = self._count(sched.scheduled)
        started = time.perf_counter()
        tokens, logprobs = self.runner.execute(sched.scheduled)
        took = time.perf_counter() - started
        self.step_histograms.observe(took, len(sched.scheduled), sched.num_tokens)
        if self.tiers is not None and prompt_tokens:  # the recompute side of load-or-recompute
            self.tiers.cost.record_prefill(prompt_tokens, took)
        sampled = []
        for s in sched.scheduled:
            s.seq.num_computed += s.num_tokens
            self.scheduler.register_computed(s.seq)
            if s.samples:
                sampled.append(s.seq)
                s.seq.layer_sink = None  # every layer was reported (model_runner): its job is done
        return outputs + self._take_tokens(sampled, tokens, logprobs)

    def _rejected(self, sched) -> list[StepOutput]:
        """Final outputs of the requests the scheduler rejected (they can never fit)."""
        outputs = []
        for seq in sched.rejected:
            self._requests.pop(seq.request_id, None)
            _abort_sink(seq, f"rejected: {seq.error}")
            outputs.append(self._output(seq, [], None))
        return outputs

    def _count(self, batch: list[ScheduledSeq]) -> int:
        """Count a step; returns its prompt tokens."""
        self.stats.steps += 1
        prompt = 0
        for s in batch:
            if s.num_tokens > 1 or s.context_len < s.seq.num_prompt_tokens:
                prompt += s.num_tokens
        self.stats.prompt_tokens += prompt
        return prompt

    def _take_tokens(self, sampled: list[Sequence], tokens: list[int], logprobs, *,
                     register: bool = False) -> list[StepOutput]:
        """Append each sampled token and answer its request. ``register``: publish prefix-cache blocks
        once the token is in (a launched step's input may have been a placeholder), short of the KV the
        step in flight is still writing."""
        outputs = []
        for seq, token, lp in zip(sampled, tokens, logprobs, strict=True):
            self.stats.generated_tokens += 1
            lps = [lp] if lp is not None else None
            if seq.prefill_only:
                seq.tokens.append(token)
                self.scheduler.pin(seq)
                seq.finish_reason = "prefilled"
                outputs.append(self._output(seq, [token], lps, block_ids=list(seq.block_table),
                                            first_scheduled_at=seq.first_scheduled_at))
                continue
            self._append(seq, token)
            if register:
                self._register(seq)
            if seq.finish_reason is not None:
                outputs.append(self._finish(seq, [token], lps))
            else:
                outputs.append(self._output(seq, [token], lps))
        return outputs

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[list[int]]:
        """Run prompts to completion in one continuous batch; the generated ids of each, in order."""
        params = params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{self._arrivals}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        errors = {}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.error:
                        errors[out.request_id] = out.error
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed: {next(iter(errors.values()))}")
        return [results[rid] for rid in ids]

    def close(self) -> None:
        """Release a tensor-parallel worker's other ranks (they leave ``TPFollower.run``); idempotent."""
        if self.tp is not None and not self._closed:
            self._closed = True
            send_stop(self.tp)
        if self.tiers is not None:
            self.tiers.close()

    # ---- internals ----------------------------------------------------------------------------
    def _get(self, request_id: str) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise UnknownRequest(f"request {request_id!r} is not held by this engine")
        return seq

    def _new_sequence(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, *,
                      prefill_only: bool = False) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise DuplicateRequest(f"request id {request_id!r} is already in use")
        prompt = checked_prompt(prompt_ids, params, vocab_size=self.model_config.vocab_size,
                                max_model_len=self.max_model_len, has_tokenizer=self.tokenizer is not None,
                                block_size=self.config.block_size, total_blocks=self.num_total_blocks,
                                prefill_only=prefill_only)
        self._arrivals += 1
        seq = Sequence(request_id, prompt, params, arrival=self._arrivals, prefill_only=prefill_only)
        if params.seed is not None and not params.greedy:
            seq.generator = make_generator(params.seed, self.device)
            if params.seed_draws:  # a continued request: resume the stream where its tokens left it
                advance_generator(seq.generator, self.model_config.vocab_size, params.seed_draws)
        if params.constraint is not None:
            if self.tp is not None and self.tp.size > 1:
                raise ValueError("structured output is not served by tensor-parallel workers yet")
            seq.grammar = self.grammars.start(params.constraint)
            if params.stop_context:  # a continuation: its answer so far is already inside the grammar
                seq.grammar.replay(prompt[len(prompt) - params.stop_context:])
        if params.stop:
            from engine.tokenizer import IncrementalDecoder

            # a continuation's tokens generated before count as generated text (stop strings may
            # begin there); the tail that can hold the start of the longest stop string is enough
            n = min(params.stop_context, len(prompt) - 1, 4 * max(map(len, params.stop)) + 16)
            seq.decoder = IncrementalDecoder(self.tokenizer, prompt_ids=prompt[:len(prompt) - n])
            seq.text = seq.decoder.push_many(prompt[len(prompt) - n:]) if n > 0 else ""
            seq.text_start = len(seq.text)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        if self.num_waiting >= self.config.max_queue:
            raise QueueFull(f"the engine queue is full ({self.config.max_queue} waiting requests); "
                            f"retry later or elsewhere")
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def _append(self, seq: Sequence, token: int) -> None:
        append_token(seq, token, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)

    def _finish(self, seq: Sequence, new_tokens: list[int], lps=None) -> StepOutput:
        self._requests.pop(seq.request_id, None)
        self._remove(seq)
        return self._output(seq, new_tokens, lps)

    def _remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the scheduler; its blocks wait for the step in flight if it writes them."""
        flight = self._inflight
        if flight is None or not flight.holds(seq):
            self.scheduler.remove(seq)
            return
        table = self.scheduler.remove(seq, keep_blocks=True)
        flight.deferred.append(table)

    def _output(self, seq: Sequence, new_tokens: list[int], lps, *, block_ids: list[int] | None = None,
                first_scheduled_at: float | None = None) -> StepOutput:
        reason = seq.finish_reason
        finished = reason is not None
        if finished:
            self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        text = seq.text[seq.text_start:] if finished and seq.decoder is not None else None
        return StepOutput(request_id=seq.request_id, new_token_ids=new_tokens, new_logprobs=lps,
                          finished=finished, finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                          num_cached_tokens=seq.num_cached_tokens, num_tier_tokens=seq.num_tier_tokens,
                          error=seq.error, invalid=seq.invalid, text=text,
                          block_ids=block_ids, first_scheduled_at=first_scheduled_at)

    def cache_snapshot(self, limit: int) -> tuple[int, dict[str, list[int]]]:
        """What the cache holds by tier, and the number of the last cache event before it (run on the
        engine thread; engine.kv_tiers.tiers.cache_snapshot)."""
        return cache_snapshot(self, limit)

    def request_states(self) -> dict[str, str]:
        """Every request this engine holds, by id: waiting / running / reserved / pinned. A worker
        compares it with what it tracks itself (e.g. the decode lease table) to name lost requests."""
        return {rid: seq.status.value for rid, seq in self._requests.items()}

    def leak_report(self) -> str | None:
        """None when no request holds KV blocks and nothing is queued; otherwise what is left."""
        problems = []
        if self._requests or self.scheduler.running or self.scheduler.waiting or self.scheduler.held:
            problems.append(f"requests still held: {sorted(self._requests)[:8]}")
        if self._inflight is not None:
            problems.append(f"a step is in flight, {len(self._inflight.deferred)} block tables wait for it")
        bm = self.block_manager.leak_report()
        if bm:
            problems.append(bm)
        tiers = self.tiers.leak_report() if self.tiers is not None else None
        if tiers:
            problems.append(tiers)
        return "; ".join(problems) or None


def _abort_sink(seq: Sequence, reason: str) -> None:
    if seq.layer_sink is not None:
        sink, seq.layer_sink = seq.layer_sink, None
        sink.abort(reason)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, dtype_name(name))
