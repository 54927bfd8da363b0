"""Several choices from one HTTP request, driven by the real `openai` client against the live 1P1D
cluster: ``n`` per prompt and batches of prompts are one router request each, and every choice is
what the gRPC door answers for its prompt (greedy choices equal; choice j of a seeded request equal
to gRPC with ``seed + j``); streamed choices interleave by index and join to the whole answer; usage
counts each prompt once; ``echo`` puts the prompt first. The shared cluster (openai_cluster.py) ends
with a leak check of every worker.
"""

from __future__ import annotations

import pytest
from openai_cluster import MODEL, openai_client
from test_openai_http import PROMPT, grpc_generate

from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


def test_n_seeded_choices_are_grpc_with_seed_plus_index(http_cluster) -> None:
    client = openai_client(http_cluster)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=77,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    for j, got in enumerate(ids):
        want, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=77 + j,
                                ignore_eos=True)
        assert got == want.token_ids and r.choices[j].text == want.text
    assert len({tuple(t) for t in ids}) > 1  # the seeds differ, so do the choices (tiny vocab: likely)
    single = client.completions.create(**kw)
    assert single.choices[0].model_extra["token_ids"] == ids[0]
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == 24


def test_batch_of_prompts_times_n_greedy(http_cluster) -> None:
    client = openai_client(http_cluster)
    tok = Tokenizer.from_dir(http_cluster.model)
    prompts = [PROMPT, "A second prompt, shorter"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        want, _ = grpc_generate(http_cluster, prompt=prompt, max_tokens=6, ignore_eos=True)
        for j in range(2):
            c = r.choices[p * 2 + j]
            assert c.model_extra["token_ids"] == want.token_ids and c.text == want.text
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    ids = tok.encode(prompts[1])  # token-id prompts batch the same way
    r2 = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in r2.choices] == [r.choices[2].model_extra["token_ids"]] * 2


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_choices_join_to_the_whole_answer(http_cluster, kind) -> None:
    client = openai_client(http_cluster)
    kw = dict(model=MODEL, max_tokens=7, n=3, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    if kind == "chat":
        call, kw["messages"] = client.chat.completions.create, [{"role": "user", "content": PROMPT}]
    else:
        call, kw["prompt"] = client.completions.create, PROMPT
    whole = call(**kw)
    chunks = list(call(stream=True, stream_options={"include_usage": True}, **kw))
    usage = [c for c in chunks if not c.choices]
    assert len(usage) == 1 and chunks[-1] is usage[0]
    assert usage[0].usage.completion_tokens == whole.usage.completion_tokens == 21
    assert usage[0].usage.prompt_tokens == whole.usage.prompt_tokens
    texts, finished = {0: "", 1: "", 2: ""}, []
    for c in chunks[:-1]:
        [choice] = c.choices
        texts[choice.index] += (choice.delta.content or "") if kind == "chat" else choice.text
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2]
    for i in range(3):
        whole_text = whole.choices[i].message.content if kind == "chat" else whole.choices[i].text
        assert texts[i] == whole_text
    if kind == "chat":  # each choice opens with the assistant's role
        roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
        assert sorted(roles) == [0, 1, 2]


def test_echo_puts_the_prompt_first(http_cluster) -> None:
    client = openai_client(http_cluster)
    kw = dict(model=MODEL, max_tokens=5, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, echo=True,
                                                                            stream=True, **kw))
    assert streamed == echoed
    tok = Tokenizer.from_dir(http_cluster.model)
    ids = tok.encode(PROMPT)
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert by_ids == tok.decode(ids, skip_special_tokens=False) + plain


def test_skip_special_tokens_false_keeps_them_in_the_text(http_cluster) -> None:
    """vLLM's ``skip_special_tokens``: every token pushed to BOS (a special token that ends nothing) is
    text with it off and no text by default; a special token that ends the answer (a stop token id)
    is never in the text. gRPC's field answers the same."""
    from engine.checkpoint import BOS_ID, BOS_TOKEN

    client = openai_client(http_cluster)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={str(BOS_ID): 100})
    kept = client.completions.create(extra_body={"skip_special_tokens": False}, **kw)
    assert kept.choices[0].text == BOS_TOKEN * 4
    assert client.completions.create(**kw).choices[0].text == ""
    stopped = client.completions.create(extra_body={"skip_special_tokens": False, "stop_token_ids": [BOS_ID]},
                                        **kw)
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    want, _ = grpc_generate(http_cluster, prompt=PROMPT, max_tokens=4, logit_bias={BOS_ID: 100},
                            skip_special_tokens=False)
    assert want.text == BOS_TOKEN * 4
