"""A disaggregated cluster over a day of requests, event by event, with windows the planner sees.

Lifecycle of a request (the pdserve path, docs/architecture.md): on arrival the router **allocates** on the
decode worker with the least load (running + waiting + allocated) and **places the prompt** on the prefill
worker that frees first (a placed prompt never moves: new workers take only new arrivals); the prompt is
computed FCFS (``Capacity.prefill_s``), and its first token is the TTFT (queueing + compute + the fixed path
cost). Its KV then **joins the decode batch** of its worker if a slot (``max_seqs``) and the KV blocks of
its whole context are free, else it waits in that worker's queue (a full batch shows as TPOT, not TTFT, as
in pdserve). A worker's batch advances one token per sequence per step; a step takes
``Capacity.tpot_s(batch, KV tokens)``, recomputed at every join and finish (held constant in between), so
TPOT = (last token - KV arrival) / (answer - 1).

Workers: ``scale(pool, n)`` is Kubernetes-like, it returns at once: a new worker holds its GPU from the
request and serves after a provisioning delay (60-120 s, seeded); a removed worker cancels a provisioning
one first, else the least loaded one **drains** (no new work, its queue and streams finish, then its
GPU is released). GPU time counts from the request to the release, within the day.

Every ``window`` seconds (``on_window``) the cluster reports a ``Signals`` built as ``signals.from_scrapes``
builds one from the metrics: counters over the window, gauges at its end, p90 of TTFT (requests whose
first token came in the window) and TPOT (requests that ended in it), the backlog estimated as queued
prompts x the window's mean prompt, replicas that answer (ready, draining included).

What the model ignores: prefix caching (no hits), chunked-prefill batching effects beyond the rate, the
KV transfer time (streamed with the prefill), context growth within an interval between events,
preemption (a sequence reserves its final context's blocks when it joins), admission refusal (off by
default, ``max_queue_wait_s`` 0: the router queues everything), worker failures, the time the router and
the planner take, and TP.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.planner_day_model import Capacity, Trace
from pdserve.app.planner.signals import Signals

_DONE, _STEP, _READY = 0, 1, 2  # event kinds: a prompt computed, a decode worker's next finish, ready


def _free_at(w: _Worker) -> float:
    return w.free_at


class _Worker:
    __slots__ = ("pool", "born", "ready_at", "died", "draining", "drain_from", "free_at", "starts", "V", "t",
                 "B", "S0", "kv", "heap", "queue", "leased", "tau", "ver", "tokens")

    def __init__(self, pool: str, born: float, ready_at: float) -> None:
        self.pool, self.born, self.ready_at = pool, born, ready_at
        self.died: float | None = None
        self.draining = False
        self.drain_from: float | None = None
        self.free_at = ready_at  # prefill: when its queue is done
        self.starts: deque[float] = deque()  # prefill: start times of prompts not yet started
        self.V = self.t = self.S0 = self.tau = self.tokens = 0.0  # decode: tokens per sequence so far
        self.B = self.kv = self.leased = self.ver = 0
        self.heap: list[tuple[float, int]] = []  # decode: (V at which it finishes, request)
        self.queue: deque[int] = deque()  # decode: KV arrived, no slot yet


@dataclass
class Result:
    """What a run produced: per request (arrival order) TTFT and TPOT; per worker its GPU time."""

    ttft: np.ndarray
    tpot: np.ndarray
    gpu_hours: float
    actions: int  # scale requests that changed a pool
    timeline: list[tuple[float, int, int]]  # (t, prefill, decode) non-draining replicas, each change


class Cluster:
    """The simulated cluster (module doc); ``run`` drives it over a trace."""

    def __init__(self, cap: Capacity, trace: Trace, *, prefill: int, decode: int, window: float = 10.0,
                 delay: tuple[float, float] = (60.0, 120.0), seed: int = 0) -> None:
        self.cap, self.trace, self.window, self.delay = cap, trace, window, delay
        self.rng = np.random.default_rng(seed + 7919)
        self.now = trace.start
        self.events: list = []
        self.seq = 0
        self.all: list[_Worker] = []
        self.actions = 0
        self.timeline: list[tuple[float, int, int]] = []
        n = len(trace)
        self.L, self.A = trace.prompt.tolist(), trace.answer.tolist()
        self.ttft, self.tpot = [math.nan] * n, [math.nan] * n
        self.t_kv, self.dw = [0.0] * n, [None] * n
        for pool, k in (("prefill", prefill), ("decode", decode)):
            for _ in range(k):
                self.all.append(_Worker(pool, trace.start, trace.start))
        self._note()
        # per-window accumulators for the signals
        self.w_prompt = self.w_reqs = 0.0
        self.placed_prompt = self.placed = 0.0
        self.computed: dict[int, float] = {}
        self.ttft_win: dict[int, list[float]] = {}
        self.tpot_win: list[float] = []
        self.tokens_before = 0.0

    # ------------------------------------------------------------------ the planner's view
    @property
    def workers(self) -> dict[str, list[_Worker]]:
        """Pool -> its workers that count as replicas: serving or provisioning, not draining."""
        out: dict[str, list[_Worker]] = {"prefill": [], "decode": []}
        for w in self.all:
            if w.died is None and not w.draining:
                out[w.pool].append(w)
        return out

    def scale(self, pool: str, n: int) -> None:
        have = self.workers[pool]
        if n > len(have):
            for _ in range(n - len(have)):
                w = _Worker(pool, self.now, self.now + float(self.rng.uniform(*self.delay)))
                self.all.append(w)
                self._push(w.ready_at, _READY, w)
        for _ in range(len(have) - n):
            pending = [w for w in have if w.ready_at > self.now]
            if pending:
                w = max(pending, key=lambda w: w.ready_at)
                w.died = self.now
            else:
                w = min(have, key=self._load)
                w.draining, w.drain_from = True, self.now
                self._retire(w)
            have.remove(w)
        self.actions += 1
        self._note()

    def _load(self, w: _Worker) -> float:
        return w.free_at if w.pool == "prefill" else w.B + len(w.queue) + w.leased

    def _note(self) -> None:
        ws = self.workers
        self.timeline.append((self.now, len(ws["prefill"]), len(ws["decode"])))

    def _retire(self, w: _Worker) -> None:
        if w.pool == "prefill":
            w.died = max(self.now, w.free_at)
        elif w.B == 0 and not w.queue and w.leased == 0:
            w.died = self.now

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def _serving(self, pool: str) -> list[_Worker]:
        return [w for w in self.all if w.pool == pool and w.died is None and not w.draining
                and w.ready_at <= self.now]

    def _arrive(self, i: int, t: float, pre: list[_Worker], dec: list[_Worker]) -> None:
        if dec:  # no decode pool: a prefill-only run (TTFT alone, for searching the prefill pool's size)
            d = min(dec, key=lambda w: w.B + len(w.queue) + w.leased)
            d.leased += 1
            self.dw[i] = d
        p = min(pre, key=_free_at)
        start = max(t, p.free_at)
        L = self.L[i]
        end = start + self.cap.prefill_s(L)
        p.free_at = end
        if start > t:
            p.starts.append(start)
        self.ttft[i] = end - t + self.cap.path_overhead_s
        self._push(end, _DONE, i)
        self.w_prompt += L
        self.w_reqs += 1
        if self.computed is not None:
            self._spread(start, end, L)
            self.ttft_win.setdefault(int((end - self.trace.start) // self.window), []).append(self.ttft[i])

    def _spread(self, start: float, end: float, tokens: float) -> None:
        w0, w1 = (int((x - self.trace.start) // self.window) for x in (start, end))
        if w0 == w1:
            self.computed[w0] = self.computed.get(w0, 0.0) + tokens
            return
        rate = tokens / (end - start)
        for k in range(w0, w1 + 1):
            lo = max(start, self.trace.start + k * self.window)
            hi = min(end, self.trace.start + (k + 1) * self.window)
            self.computed[k] = self.computed.get(k, 0.0) + rate * (hi - lo)

    def _advance(self, d: _Worker, t: float) -> None:
        if d.B:
            dv = (t - d.t) / d.tau
            d.V += dv
            d.tokens += d.B * dv
        d.t = t

    def _admit(self, d: _Worker, i: int) -> bool:
        blocks = -(-(self.L[i] + self.A[i]) // 16)
        if d.B >= self.cap.max_seqs or d.kv + blocks > self.cap.kv_blocks:
            return False
        d.B += 1
        d.kv += blocks
        d.S0 += self.L[i] + 1 - d.V
        heapq.heappush(d.heap, (d.V + self.A[i] - 1, i))
        return True

    def _reschedule(self, d: _Worker, t: float) -> None:
        d.ver += 1
        if d.B:
            d.tau = self.cap.tpot_s(d.B, d.S0 + d.B * d.V)
            self._push(t + max(d.heap[0][0] - d.V, 0.0) * d.tau, _STEP, (d, d.ver))
        elif d.draining and not d.queue and d.leased == 0:
            d.died = t

    def _kv_arrived(self, i: int, t: float) -> None:
        d = self.dw[i]
        self.t_kv[i] = t
        d.leased -= 1
        self._advance(d, t)
        if d.queue or not self._admit(d, i):
            d.queue.append(i)
        self._reschedule(d, t)

    def _step_done(self, d: _Worker, t: float) -> None:
        self._advance(d, t)
        while d.heap and d.heap[0][0] <= d.V + 1e-9:
            v, i = heapq.heappop(d.heap)
            d.B -= 1
            d.kv -= -(-(self.L[i] + self.A[i]) // 16)
            d.S0 -= self.L[i] + 1 - (v - (self.A[i] - 1))
            self.tpot[i] = (t - self.t_kv[i]) / max(self.A[i] - 1, 1)
            if self.tpot_win is not None:
                self.tpot_win.append(self.tpot[i])
        while d.queue and self._admit(d, d.queue[0]):
            d.queue.popleft()
        if not d.B:
            d.S0 = 0.0
        self._reschedule(d, t)

    # ------------------------------------------------------------------ the run
    def run(self, on_window: Callable[[Cluster, Signals], None] | None = None) -> Result:
        """Serve the trace; call ``on_window`` at each window's end up to the day's end, then serve what
        is left. ``on_window`` may call ``scale``."""
        if on_window is None:
            self.computed = self.ttft_win = self.tpot_win = None  # type: ignore[assignment]
        at, n = self.trace.at.tolist(), len(self.trace)
        i = 0
        pre, dec = self._serving("prefill"), self._serving("decode")
        t_end = self.trace.start
        while True:
            t_end += self.window
            last = t_end >= self.trace.end
            limit = math.inf if last else t_end
            while True:
                ta = at[i] if i < n else math.inf
                te = self.events[0][0] if self.events else math.inf
                if min(ta, te) >= limit:
                    break
                if ta <= te:
                    self.now = ta
                    self._arrive(i, ta, pre, dec)
                    i += 1
                    continue
                t, _, kind, obj = heapq.heappop(self.events)
                self.now = t
                if kind == _DONE:
                    if self.dw[obj] is None:
                        self.tpot[obj] = 0.0
                    else:
                        self._kv_arrived(obj, t + self.cap.path_overhead_s)
                elif kind == _STEP:
                    if obj[1] == obj[0].ver:
                        self._step_done(obj[0], t)
                elif obj.died is None:  # _READY
                    pre, dec = self._serving("prefill"), self._serving("decode")
            if last:
                break
            self.now = t_end
            if on_window is not None:
                on_window(self, self._signals(t_end))
                pre, dec = self._serving("prefill"), self._serving("decode")
        for w in self.all:  # anything still draining is released when its work ends
            if w.died is None and w.draining:
                w.died = max(w.free_at, self.now)
        end = self.trace.end
        hours = sum(max(min(w.died if w.died is not None else end, end) - max(w.born, 0.0), 0.0)
                    for w in self.all) / 3600.0
        return Result(ttft=np.array(self.ttft), tpot=np.array(self.tpot), gpu_hours=hours,
                      actions=self.actions, timeline=self.timeline)

    def _signals(self, t: float) -> Signals:
        k = int(round((t - self.trace.start) / self.window)) - 1
        alive = [w for w in self.all if (w.died is None or w.died > t) and w.ready_at <= t]
        waiting = running = dwait = used = total = tokens = 0.0
        for w in alive:
            if w.pool == "prefill":
                while w.starts and w.starts[0] <= t:
                    w.starts.popleft()
                waiting += len(w.starts)
            else:
                self._advance(w, t)
                running += w.B
                dwait += len(w.queue)
                used += w.kv
                total += self.cap.kv_blocks
        for w in self.all:
            if w.pool == "decode":
                tokens += w.tokens
        self.placed_prompt += self.w_prompt
        self.placed += self.w_reqs
        mean = self.w_prompt / self.w_reqs if self.w_reqs else (
            self.placed_prompt / self.placed if self.placed else 0.0)
        ttfts, tpots = self.ttft_win.pop(k, []), self.tpot_win
        s = Signals(at=t, window_s=self.window, prompt_tokens=self.w_prompt, requests=self.w_reqs,
                    prefill_computed_tokens=self.computed.pop(k, 0.0),
                    output_tokens=tokens - self.tokens_before, backlog_prompt_tokens=waiting * mean,
                    prefill_waiting=waiting, decode_running=running, decode_waiting=dwait,
                    kv_blocks_used=used, kv_blocks_total=total,
                    ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts else None,
                    tpot_p90_s=float(np.percentile(tpots, 90)) if tpots else None,
                    prefill_replicas=sum(w.pool == "prefill" for w in alive),
                    decode_replicas=sum(w.pool == "decode" for w in alive))
        self.tokens_before = tokens
        self.w_prompt = self.w_reqs = 0.0
        self.tpot_win = []
        return s
