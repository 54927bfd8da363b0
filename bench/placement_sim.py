"""Placement simulations for the issue's "must show" numbers that need no real workers.

``python -m bench.placement_sim [--json OUT]`` prints:
- multi-turn chat: prompt-cache hit ratio and KV bytes sent per policy (affinity on vs off),
  with caches simulated by ``SimCluster`` (engine's real block hashes, bounded LRU per worker);
- shared system prompt: requests per decode/prefill worker, max/mean, against the bound.
The end-to-end versions with real workers feed real outcomes through the same ``on_result``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

from bench.placement_fakes import SimCluster, chat_tokens, request, workers
from router.placement.config import PlacerConfig
from router.placement.placer import Placer


@dataclass(frozen=True, kw_only=True)
class ChatResult:
    policy: str
    hit_ratio: float
    prefill_hit_ratio: float
    bytes_sent: int
    bytes_no_reuse: int
    session_moves: int


def chat_workload(policy: str, *, sessions: int = 20, turns: int = 5, n_prefill: int = 2, n_decode: int = 3,
                  system_len: int = 256, user_len: int = 64, answer_len: int = 64,
                  capacity_blocks: int = 4096, seed: int = 0) -> ChatResult:
    """``sessions`` chats interleaved turn by turn; each turn's prompt is the whole history."""
    rng = random.Random(seed)
    bs = 16
    pl = Placer(PlacerConfig(policy=policy, block_size=bs))
    infos = workers(n_prefill, n_decode)
    pl.update_workers(infos)
    sim = SimCluster(infos, capacity_blocks=capacity_blocks, block_size=bs)
    system = chat_tokens(rng, system_len)
    history = {s: list(system) for s in range(sessions)}
    for turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)  # chats do not arrive in lockstep order...
        wave = []
        for s in order:  # ...but they do overlap: a whole turn's requests are in flight together
            prompt = history[s] + chat_tokens(rng, user_len)
            req = request(f"s{s}-t{turn}", prompt, bs, session_id=f"s{s}")
            wave.append((s, prompt, req, pl.place(req)))
        for s, prompt, req, placement in wave:
            answer = chat_tokens(rng, answer_len)
            pl.on_result(req, placement, sim.run(req, placement, generated=answer, prompt_tokens=prompt))
            history[s] = prompt + answer
    moves = int(sum(m.get() for m in _children(pl.metrics.session_moves)))
    st = sim.stats
    return ChatResult(policy=policy, hit_ratio=st.hit_ratio, prefill_hit_ratio=st.prefill_hit_ratio,
                      bytes_sent=st.bytes_sent, bytes_no_reuse=st.bytes_no_reuse, session_moves=moves)


def _children(counter):
    return [c._value for c in counter._metrics.values()]


@dataclass(frozen=True, kw_only=True)
class BalanceResult:
    policy: str
    requests: int
    decode_max: int
    decode_mean: float
    prefill_max: int
    prefill_mean: float
    bound: int  # ceil((1 + eps) * mean): the most a worker may take while others have room
    peak_inflight_max_over_mean: float


def shared_prompt_workload(policy: str = "prefix", *, requests: int = 600, concurrency: int = 32,
                           n_prefill: int = 4, n_decode: int = 8, system_len: int = 2048,
                           suffix_len: int = 96, epsilon: float = 0.25, seed: int = 1) -> BalanceResult:
    """Every prompt = one long system prompt + a short unique suffix; ``concurrency`` in flight."""
    import math

    rng = random.Random(seed)
    bs = 16
    pl = Placer(PlacerConfig(policy=policy, block_size=bs, epsilon=epsilon))
    infos = workers(n_prefill, n_decode)
    pl.update_workers(infos)
    sim = SimCluster(infos, capacity_blocks=1 << 16, block_size=bs)
    system = chat_tokens(rng, system_len)
    inflight: list = []
    peak = 0.0
    for i in range(requests):
        req = request(f"r{i}", system + chat_tokens(rng, suffix_len), bs)
        inflight.append((req, pl.place(req)))
        if len(inflight) >= concurrency:
            loads = [pl.view.inflight(w.worker_id) for w in infos if w.role == "decode"]
            peak = max(peak, max(loads) / (sum(loads) / len(loads)))
            # Requests finish in random order (their lengths differ).
            r, p = inflight.pop(rng.randrange(len(inflight)))
            pl.on_result(r, p, sim.run(r, p))
    for r, p in inflight:
        pl.on_result(r, p, sim.run(r, p))
    per = sim.stats.per_worker
    dec = [per.get(w.worker_id, 0) for w in infos if w.role == "decode"]
    pre = [per.get(w.worker_id, 0) for w in infos if w.role == "prefill"]
    return BalanceResult(policy=policy, requests=requests,
                         decode_max=max(dec), decode_mean=sum(dec) / len(dec),
                         prefill_max=max(pre), prefill_mean=sum(pre) / len(pre),
                         bound=math.ceil((1 + epsilon) * concurrency / n_decode),
                         peak_inflight_max_over_mean=peak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    chats = [chat_workload(p) for p in ("prefix", "prefix_only", "least_loaded", "round_robin")]
    bal = [shared_prompt_workload(p) for p in ("prefix", "prefix_only", "least_loaded", "round_robin")]
    # Cache affinity alone (no bound) piles the work onto the holders of the prompt.
    unbounded = shared_prompt_workload("prefix", epsilon=1000.0)
    print("5-turn chat (20 sessions, 2 prefill x 3 decode)")
    print(f"{'policy':<16}{'hit ratio':>10}{'prefill hit':>12}{'bytes sent':>14}"
          f"{'vs no reuse':>12}{'moves':>7}")
    for c in chats:
        print(f"{c.policy:<16}{c.hit_ratio:>10.3f}{c.prefill_hit_ratio:>12.3f}{c.bytes_sent:>14d}"
              f"{c.bytes_sent / c.bytes_no_reuse:>12.3f}{c.session_moves:>7d}")
    print("\nshared 2048-token system prompt (600 requests, 32 in flight, 4 prefill x 8 decode)")
    print(f"{'policy':<18}{'decode max/mean':>16}{'prefill max/mean':>18}{'peak inflight max/mean':>24}")
    for b in bal + [unbounded]:
        name = "prefix e=1000" if b is unbounded else b.policy
        print(f"{name:<18}{b.decode_max:>9d}/{b.decode_mean:<8.1f}{b.prefill_max:>9d}/{b.prefill_mean:<8.1f}"
              f"{b.peak_inflight_max_over_mean:>24.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chat": [c.__dict__ for c in chats], "shared_prompt": [b.__dict__ for b in bal],
                       "shared_prompt_unbounded": unbounded.__dict__}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
