"""Two colocated workers behind one router (`--mode colocated`, what `pdserve up --colocated 2` starts).

No prefill pool: the router places each request on a colocated worker through the same Placer
(``session+prefix``), Allocates there and Decodes with ``prefill_locally``. Covers: concurrent greedy
output token-identical to one engine, both workers used, every request reported as
``prefill_mode=local`` / ``no_prefill_pool``, a session's turns staying on one worker and reusing its KV,
the workers still serving the Router API themselves (the old baseline), and the leak checks
(free blocks back, nothing leased or running, the router's in-flight gauge at 0).
"""

from __future__ import annotations

import pytest
from test_cluster_1p1d import reference, run_concurrently
from test_conditional_disagg import ids, metered_cluster, scrape, wait_clean

from pdserve.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(make_checkpoint, tmp_path_factory):
    with metered_cluster(make_checkpoint("llama"), tmp_path_factory.mktemp("coloc"), prefill=0, decode=2,
                         colocated=True) as c:
        yield c


@pytest.fixture
def clean(cluster):
    yield
    wait_clean(cluster, cluster.metrics_port)


def test_router_fronts_colocated_workers_token_identical(cluster, clean) -> None:
    with Client(cluster.router, timeout=30) as c:
        workers = c.list_workers()
    assert sorted(w["role"] for w in workers) == ["decode", "decode"]  # the router's pool name
    assert all(w["healthy"] and w["stats"]["role"] == "colocated" for w in workers)
    lens = [4, 16, 33, 70, 100, 130]
    max_tokens = [7, 5, 9, 4, 8, 6]
    ps = [ids(300 + n, n) for n in lens]
    want = reference(cluster.model, ps, max_tokens)
    got = run_concurrently(cluster.router, ps, max_tokens, ignore_eos=True)
    assert [r.token_ids for r in got] == want
    for r in got:
        f = r.final
        assert (f["prefill_mode"], f["prefill_mode_reason"]) == ("local", "no_prefill_pool")
        assert f["transport"] == "local"
        assert f["prefill_worker"] == f["decode_worker"] and f["decode_worker"].startswith("colocated")
        assert f["kv_blocks_sent"] == 0 and f["usage"]["completion_tokens"] == len(r.token_ids)
    assert len({r.final["decode_worker"] for r in got}) == 2  # the load bound spreads 6 requests
    m = scrape(cluster.metrics_port)
    assert m['pdserve_router_prefill_decisions_total{mode="local",reason="no_prefill_pool"}'] >= 6


def test_session_stays_on_one_colocated_worker_and_reuses_its_kv(cluster, clean) -> None:
    prompt = ids(21, 50)
    turns = []
    with Client(cluster.router, timeout=120) as c:
        for t in range(3):
            r = c.generate(prompt_ids=prompt, max_tokens=8, ignore_eos=True, session_id="s-coloc")
            turns.append((prompt, r))
            prompt = prompt + r.token_ids + ids(22 + t, 10)
    assert len({r.final["decode_worker"] for _, r in turns}) == 1
    assert [r.final["session_hit"] for _, r in turns] == [False, True, True]
    # turn n+1 finds turn n's prompt + answer (minus the last token) in that worker's cache
    for (p, r), (_, nxt) in zip(turns, turns[1:], strict=False):
        assert nxt.final["kv_blocks_reused"] == (len(p) + len(r.token_ids) - 1) // 16
    want = reference(cluster.model, [p for p, _ in turns], [8, 8, 8])
    assert [r.token_ids for _, r in turns] == want


def test_colocated_worker_still_serves_the_router_api_itself(cluster, clean) -> None:
    prompt = ids(5, 20)
    w = cluster.workers[0]
    with Client(w.address, timeout=60) as c:
        direct = c.generate(prompt_ids=prompt, max_tokens=6, ignore_eos=True)
    assert direct.final["transport"] == "local" and direct.token_ids == reference(cluster.model, [prompt],
                                                                                     [6])[0]
