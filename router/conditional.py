"""Conditional disaggregation: should the decode worker prefill a prompt itself?

Disaggregation pays a fixed price per request (a prefill RPC, a transfer handshake, moving the KV of
the uncached suffix) to keep long prefills from stalling the decode batch. For a short uncached
suffix — a short prompt, or the next turn of a chat whose history the decode worker still caches —
that price exceeds what it saves, and the decode worker should compute the suffix locally.

Every number comes from the router's one cost model (``router/costs.py``) and its one picture of
the cluster (``router/state/workers.py``), the same ones placement scores pairs with, and is decided
right after ``Allocate`` (when the decode worker's cached prefix is known). ``Paths`` holds the
estimates; ``decide`` is a pure function of them:

    local path:   decode_wait + local       the decode worker's own queue of local prefills, then
                                            computing the suffix at its rate (TTFT); ``recompute`` =
                                            local x (1 + load_weight x running / capacity) is what it
                                            costs the decode batch as well
    remote path:  prefill_wait + remote + transfer
                                            the prefill worker's queue, its compute, the KV push

Rules, in order: disabled -> remote; ``uncached <= min_uncached_tokens`` -> local ("short_suffix");
transfer slower than recompute -> local ("transfer_slower"); the prefill worker's queue longer than
``max_prefill_wait_s`` and the local path (with the decode batch's share) faster than the remote one
-> local ("prefill_busy"); else remote ("disaggregate"). Then guards on any local choice. The
decode worker's own queue: with the load rule on (``max_prefill_wait_s > 0``) a local path slower
than the remote one goes remote ("decode_busy"), so under overload the decision never picks the
worse path by looking at one queue only, and while streams run there a local prefill costing more
than ``max_local_stall_s`` goes remote ("decode_stall"): each running stream waits for all of it, so
a long local prefill under load trades one request's TTFT for every stream's TPOT. For the same
reason a prompt spills off a busy prefill queue ("prefill_busy") only if the TTFT it saves exceeds
the delay it adds to the streams there, summed (``stall_weight x local_s x other_streams``): when
both pools are saturated, spilling only moves the queue into every stream's inter-token latency
(on 2x H200 under the log-normal mix, local prefills of up to 250 ms took the conditional mode's
SLO goodput from 1P1D's 14 req/s down to 10, with ITL p90 51 ms against 17). The budget: every
local prefill spends the decode worker's local-prefill budget (``local_duty`` of its time,
``local_burst_s`` at once;
``router/prefill_load.py``); without it the prompt goes to the prefill pool ("local_budget"), so a
short-prompt flood or a long prefill queue cannot turn the decode GPU into a second, interfering
prefill GPU. A router without a prefill pool (it fronts colocated workers) prefills every prompt
where it decodes ("no_prefill_pool").

The load rule is what Dynamo calls conditional disaggregation by queue length: under a burst the
prefill GPU's queue (and with it TTFT) grows while the decode GPU has spare compute; handing it a
budgeted share of the prompts keeps TTFT bounded at a small, bounded cost in decode stalls.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.placement import Placement, Placer
from router.prefill_load import LocalBudget


@dataclass(frozen=True, kw_only=True)
class ConditionalConfig:
    enabled: bool = True
    # At or below this many uncached prompt tokens the decode worker prefills locally.
    min_uncached_tokens: int = 256
    # Local prefill delays every request in the decode batch: its cost x (1 + weight x running/cap).
    load_weight: float = 1.0
    # Load rule: prefill locally when the prefill worker's estimated queue wait exceeds this (s), and
    # weigh the decode worker's own queue on every local choice; 0 = off.
    max_prefill_wait_s: float = 0.5
    # Budget of every local prefill: at most this share of a decode worker's time (1 = no limit), and at
    # most local_burst_s seconds of prefill back to back.
    local_duty: float = 0.25
    local_burst_s: float = 0.25
    # With the load rule on and streams running on the decode worker, no single local prefill may cost
    # more than this (s): every running stream waits for it, so it is what one local prefill adds to
    # their inter-token latency.
    max_local_stall_s: float = 0.05
    # ... and a spill off a busy prefill queue must save more TTFT than stall_weight x the delay it adds
    # to those streams, summed (0 = not weighed)
    stall_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0:
            raise ValueError("ConditionalConfig.min_uncached_tokens must be >= 0")
        if not 0 < self.local_duty <= 1:
            raise ValueError(f"ConditionalConfig.local_duty must be in (0, 1], got {self.local_duty}")
        for name in ("load_weight", "max_prefill_wait_s", "local_burst_s", "max_local_stall_s",
                     "stall_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"ConditionalConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class Paths:
    """The cost model's estimates for one prompt on one placed pair (seconds)."""

    uncached_tokens: int
    local_s: float            # the decode worker computing the uncached suffix
    remote_s: float           # the prefill worker computing what it does not cache
    transfer_s: float         # pushing the suffix's KV over the (prefill, decode) link
    prefill_wait_s: float = 0.0   # queued ahead of it on the prefill worker
    decode_wait_s: float = 0.0    # local prefills queued ahead of it on the decode worker
    decode_running: int = 0
    decode_capacity: int = 1
    other_streams: int = 0  # requests on the decode worker besides this one (each waits out a local prefill)

    @property
    def load_factor(self) -> float:
        return 1.0 + max(self.decode_running, 0) / max(self.decode_capacity, 1)


@dataclass(frozen=True)
class Decision:
    local: bool
    # disabled | short_suffix | transfer_slower | prefill_busy | decode_busy | decode_stall | local_budget
    # | disaggregate | no_prefill_pool
    reason: str
    uncached_tokens: int
    transfer_s: float = 0.0
    recompute_s: float = 0.0
    prefill_wait_s: float = 0.0
    decode_wait_s: float = 0.0
    local_path_s: float = 0.0   # estimated time to the first token on each path
    remote_path_s: float = 0.0


LOCAL_REASONS = ("short_suffix", "transfer_slower", "prefill_busy")


def decide(paths: Paths, config: ConditionalConfig, *, local_budget_s: float = float("inf")) -> Decision:
    """Prefill locally on the decode worker (``local=True``) or disaggregate; see the module doc.

    ``local_budget_s``: the decode worker's local-prefill seconds left (a prompt fits if it costs no
    more, or the bucket is at least full)."""
    if paths.uncached_tokens <= 0:
        raise ValueError(f"need uncached_tokens > 0, got {paths.uncached_tokens}")
    load_rule = config.max_prefill_wait_s > 0
    recompute = paths.local_s * (1.0 + config.load_weight * (paths.load_factor - 1.0))
    decode_wait = paths.decode_wait_s if load_rule else 0.0
    prefill_wait = max(paths.prefill_wait_s, 0.0)
    local_path = decode_wait + paths.local_s
    remote_path = (prefill_wait if load_rule else 0.0) + paths.remote_s + paths.transfer_s
    if not config.enabled:
        reason = "disabled"
    elif paths.uncached_tokens <= config.min_uncached_tokens:
        reason = "short_suffix"
    elif paths.transfer_s > recompute:
        reason = "transfer_slower"
    elif load_rule and prefill_wait > config.max_prefill_wait_s and decode_wait + recompute < remote_path:
        reason = "prefill_busy"
    else:
        reason = "disaggregate"
    local = reason in LOCAL_REASONS
    if local and load_rule and local_path > remote_path:
        local, reason = False, "decode_busy"
    if local and load_rule and paths.other_streams > 0 and (
            paths.local_s > config.max_local_stall_s
            or (reason == "prefill_busy"
                and remote_path - local_path < config.stall_weight * paths.local_s * paths.other_streams)):
        local, reason = False, "decode_stall"
    if local and local_budget_s < min(paths.local_s, config.local_burst_s):
        local, reason = False, "local_budget"
    return Decision(local=local, reason=reason, uncached_tokens=paths.uncached_tokens,
                    transfer_s=paths.transfer_s, recompute_s=recompute, prefill_wait_s=prefill_wait,
                    decode_wait_s=decode_wait, local_path_s=local_path, remote_path_s=remote_path)


class PrefillModePolicy:
    """The router's side: builds ``Paths`` for a placed pair from the placer's worker view and cost
    model, decides, and records the choice there.

    Inputs: the decode worker's cached prefix (from its Allocate); from the view, the decode worker's
    load and batch capacity, the prompt tokens queued on the prefill worker ahead of this one and the
    local prefills queued on the decode worker; from the cost model, both workers' prefill rates, the
    (prefill, decode) link and the decode worker's KV size per token. A local choice spends the decode
    worker's budget and moves the prompt's place in the queues from the prefill worker to the decode
    worker. Every decision is counted in ``pdserve_router_prefill_decisions_total{mode, reason}``.
    """

    def __init__(self, config: ConditionalConfig | None, placer: Placer) -> None:
        self.config = config if config is not None else ConditionalConfig(enabled=False)
        self.placer = placer
        self.counter = placer.metrics.prefill_decisions
        self.budget = LocalBudget(self.config.local_duty, self.config.local_burst_s)

    def paths(self, request_id: str, prompt_tokens: int, cached_tokens: int, placement: Placement) -> Paths:
        if prompt_tokens <= 0 or cached_tokens < 0:
            raise ValueError(f"need prompt_tokens > 0 and cached_tokens >= 0, got {prompt_tokens}, "
                             f"{cached_tokens}")
        view, costs = self.placer.view, self.placer.costs
        bs = self.placer.config.block_size
        cached = min(cached_tokens, prompt_tokens - 1)  # the last prompt token is always computed
        uncached = prompt_tokens - cached
        d = placement.decode.worker_id
        info = view.workers.get(d)
        paths = dict(uncached_tokens=uncached, local_s=costs.prefill_s(d, uncached, cached),
                     decode_wait_s=costs.queue_s(d, view.outstanding_tokens(d), view.busy_for(d)),
                     decode_running=view.load_of(d), decode_capacity=(info.max_num_seqs if info else 0) or 1,
                     # this request is placed, so the view counts it on d already
                     other_streams=max(view.load_of(d) - 1, 0))
        if placement.prefill is None:
            return Paths(remote_s=0.0, transfer_s=0.0, **paths)
        p = placement.prefill.worker_id
        p_cached = min(placement.predicted_prefill_cached_blocks * bs, prompt_tokens - 1)
        ahead = view.outstanding_tokens(p) - view.own_prefill_tokens(request_id)
        return Paths(remote_s=costs.prefill_s(p, prompt_tokens - p_cached, p_cached),
                     transfer_s=costs.transfer_s(p, d, uncached),
                     prefill_wait_s=costs.queue_s(p, ahead, view.busy_for(p)),
                     **paths)

    def decide(self, request_id: str, prompt_tokens: int, cached_tokens: int,
               placement: Placement) -> Decision:
        paths = self.paths(request_id, prompt_tokens, cached_tokens, placement)
        d = placement.decode.worker_id
        if placement.prefill is None:
            out = Decision(local=True, reason="no_prefill_pool", uncached_tokens=paths.uncached_tokens,
                           recompute_s=paths.local_s, local_path_s=paths.local_s)
        else:
            out = decide(paths, self.config, local_budget_s=self.budget.available(d))
            if out.local:
                self.budget.take(d, paths.local_s)
        if out.local:
            self.placer.view.move_prefill(request_id, d, paths.uncached_tokens)
        self.counter.labels(mode="local" if out.local else "remote", reason=out.reason).inc()
        return out

