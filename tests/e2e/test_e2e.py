"""End-to-end: the same tests against every deployment lane (see conftest.py / e2e_targets.py).

1. Greedy output through the disaggregated cluster is token-identical to the single engine.
2. Every turn of a session lands on the same decode worker.
   Both hold over the router's OpenAI-compatible HTTP door too (the `openai` client).
3. Scaling the decode pool up and down while requests flow loses no request.
4. Killing (up) / deleting (kind) a decode worker under load hangs no request and the service goes on.

Tests share one deployment per lane, in any order (random by default): the kill test breaks a
deployment of its own (``own_target``: a fresh ``pdserve up`` in the up lane; in the kind lane
Kubernetes replaces the deleted pod), and the scale test first waits for a whole decode pool.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.app.cli import main as cli_main
from pdserve.client import Client

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    " ".join(str(i) for i in range(1, 60)),
    "Hello",
]
MAX_TOKENS = 12
REQUEST_TIMEOUT = 90.0  # a request still running after this is a hang
OK_FINISH = {"length", "stop"}
# What an in-flight request may end with when its decode worker dies: a clear status, never a hang.
WORKER_LOSS_CODES = {"UNAVAILABLE", "ABORTED"}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Greedy single-engine answers: `pdserve generate --json` on the same checkpoint, run through the CLI
    entry point in this process (same code path as the command; torch is imported once, not per prompt)."""

    @functools.cache
    def answer(prompt: str, max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> tuple[int, ...]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli_main(["generate", "--model", str(tiny_model), "--prompt", prompt,
                             "--max-tokens", str(max_tokens), "--temperature", "0", "--json",
                             *(["--ignore-eos"] if ignore_eos else [])])
        assert code == 0, f"pdserve generate exited {code}: {out.getvalue()[-2000:]}"
        return tuple(json.loads(out.getvalue().strip().splitlines()[-1])["token_ids"])

    return answer


def generate(router: str, prompt: str, *, max_tokens: int = MAX_TOKENS, session: str = "",
             ignore_eos: bool = False):
    with Client(router) as c:
        return c.generate(prompt=prompt, max_tokens=max_tokens, session_id=session, temperature=0.0,
                          ignore_eos=ignore_eos, timeout=REQUEST_TIMEOUT)


def decode_workers(router: str) -> list[dict]:
    with Client(router, timeout=10) as c:
        return [w for w in c.list_workers() if w.get("role") == "decode" and w.get("healthy", False)]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except grpc.RpcError as exc:  # the router itself must stay up, but tolerate a transient blip
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Load:
    """Closed-loop clients sending requests until stopped; every outcome is recorded."""

    def __init__(self, router: str, *, clients: int = 3, max_tokens: int = 16,
                 ignore_eos: bool = True) -> None:
        self.router, self.max_tokens, self.ignore_eos = router, max_tokens, ignore_eos
        self.results: list[tuple[float, object]] = []  # (end time, Result | "STATUS: details")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            prompt = f"Client {i} request {n}: {PROMPTS[n % len(PROMPTS)]}"
            try:
                outcome: object = generate(self.router, prompt, max_tokens=self.max_tokens,
                                           ignore_eos=self.ignore_eos)
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {exc.details()}"
            with self._lock:
                self.results.append((time.monotonic(), outcome))

    def done(self) -> int:
        with self._lock:
            return len(self.results)

    def wait_done(self, n: int, timeout: float = REQUEST_TIMEOUT) -> None:
        wait_until(lambda: self.done() >= n, timeout, f"{n} completed requests under load")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT + 10)
        hung = [t.name for t in self._threads if t.is_alive()]
        assert not hung, f"requests still hanging after {REQUEST_TIMEOUT}s: {hung}"

    def errors(self) -> list[str]:
        return [o for _, o in self.results if isinstance(o, str)]

    def ok(self) -> list:
        return [o for _, o in self.results if not isinstance(o, str)]


def test_greedy_output_matches_single_engine_reference(target, reference) -> None:
    expected = {p: reference(p) for p in PROMPTS}
    batch = PROMPTS * 2  # 8 concurrent requests of mixed lengths
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda p: generate(target.router, p), batch))
    for prompt, r in zip(batch, results, strict=True):
        assert tuple(r.token_ids) == expected[prompt], f"{target.name}: output differs for {prompt[:30]!r}"
        assert r.finish_reason in OK_FINISH
        assert r.final["prefill_worker"] and r.final["decode_worker"]
        assert r.final["transport"] == target.transport
    assert len({r.final["decode_worker"] for r in results}) >= 1


def test_session_affinity_same_decode_worker_every_turn(target, reference) -> None:
    session = f"e2e-{uuid.uuid4().hex[:8]}"
    history = "System: you are a terse assistant."
    placements, last = [], None
    for turn in range(4):
        prompt = f"{history}\nUser: turn {turn}, tell me more.\nAssistant:"
        last = generate(target.router, prompt, max_tokens=8, session=session)
        assert last.finish_reason in OK_FINISH
        placements.append(last.final["decode_worker"])
        assert not last.final.get("session_moved"), f"turn {turn} moved: {placements}"
        history = prompt + last.text
    assert len(set(placements)) == 1, f"{target.name}: session visited {placements}"
    # KV reuse across turns must not change the answer: the last turn equals the single engine's.
    assert tuple(last.token_ids) == reference(prompt, 8)


def test_http_door_matches_reference_and_keeps_sessions(target, reference) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{target.http}/v1", api_key="none", max_retries=0,
                    timeout=REQUEST_TIMEOUT)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: client.completions.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True}), PROMPTS))
    for prompt, r in zip(PROMPTS, results, strict=True):
        choice = r.choices[0]
        assert tuple(choice.model_extra["token_ids"]) == reference(prompt), \
            f"{target.name}: HTTP output differs for {prompt[:30]!r}"
        assert choice.finish_reason in OK_FINISH
        assert r.model_extra["pdserve"]["transport"] == target.transport
    session = f"e2e-http-{uuid.uuid4().hex[:8]}"
    messages, placements = [{"role": "system", "content": "You are terse."}], []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}, tell me more."})
        text, final = "", {}
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True,
                                                    extra_headers={"x-session-affinity": session}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                final = chunk.model_extra.get("pdserve") or final
        placements.append(final["decode_worker"])
        assert not final["session_moved"]
        messages.append({"role": "assistant", "content": text})
    assert len(set(placements)) == 1, f"{target.name}: HTTP session visited {placements}"


def test_scale_decode_pool_while_requests_flow(target) -> None:
    before = {w["worker_id"] for w in wait_until(lambda: len(decode_workers(target.router)) == 2
                                                 and decode_workers(target.router), 180,
                                                 "router to see the 2 healthy decode workers deployed")}
    with Load(target.router) as load:
        load.wait_done(3)
        target.scale_decode(3)
        grown = wait_until(lambda: len(decode_workers(target.router)) == 3 and decode_workers(target.router),
                           180, "router to see 3 healthy decode workers")
        mark = load.done()
        load.wait_done(mark + 3)
        target.scale_decode(2)
        wait_until(lambda: len(decode_workers(target.router)) == 2, 180, "router to see 2 decode workers")
        mark = load.done()
        load.wait_done(mark + 3)
    assert {w["worker_id"] for w in grown} > before
    assert load.errors() == [], f"{target.name}: requests failed while scaling: {load.errors()}"
    assert len(load.ok()) >= 9
    assert all(r.finish_reason in OK_FINISH for r in load.ok())


def test_losing_a_decode_worker_under_load(own_target) -> None:
    target = own_target
    workers = wait_until(lambda: len(decode_workers(target.router)) >= 2 and decode_workers(target.router),
                         180, "router to see 2 healthy decode workers")
    victim = workers[0]["worker_id"]
    born = workers[0].get("stats", {}).get("incarnation")

    def victim_gone_or_reborn() -> bool:
        # Gone (kind: a new pod takes its place under another name), or already back under a new
        # incarnation (up: the launcher restarts it; on a fast machine before a poll sees it gone).
        now = {w["worker_id"]: w.get("stats", {}).get("incarnation") for w in decode_workers(target.router)}
        return victim not in now or now[victim] != born

    with Load(target.router, clients=4, max_tokens=48) as load:
        load.wait_done(4)
        target.kill_decode_worker(victim)
        wait_until(victim_gone_or_reborn, 120, f"router to drop decode worker {victim}")
        mark = load.done()
        load.wait_done(mark + 4)
    # No hang (Load.stop asserted every request returned); failures only with a worker-loss status.
    unexpected = [e for e in load.errors() if e.split(":", 1)[0] not in WORKER_LOSS_CODES]
    assert unexpected == [], f"{target.name}: unexpected failures {unexpected}"
    assert len(load.ok()) >= 4
    # The service continues (on the remaining workers, or on the victim's restarted process).
    after = [generate(target.router, p) for p in PROMPTS]
    assert all(r.finish_reason in OK_FINISH for r in after)
