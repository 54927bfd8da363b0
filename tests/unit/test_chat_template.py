"""router/chat_template.py renders exactly what transformers' apply_chat_template renders.

Three real template families (tests/unit/chat_templates/: Llama 3, Qwen2's ChatML with its default
system prompt, Mistral's with raise_exception on bad role order and whitespace control) over the
same conversations, as text and as token ids; where the template lives (chat_template.jinja,
tokenizer_config.json string or named list, none); the sandbox; what `pdserve model init` writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from router.chat_template import ChatTemplate, ChatTemplateError

TEMPLATES = Path(__file__).parent / "chat_templates"
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is KV cache?"}],
    [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me about \"quotes\" & <tags> and ünïcödé."}],
]


def _model_dir(tmp_path: Path, src: Path, template: str | list | None, *, as_file: bool = False,
               bos: str = "<|begin_of_text|>", eos: str = "<|end_of_text|>") -> Path:
    out = tmp_path / "model"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
           "clean_up_tokenization_spaces": False}
    if as_file:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


def _source(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8").rstrip("\n")


@pytest.mark.parametrize("name", ["llama3.jinja", "chatml_qwen2.jinja", "mistral.jinja"])
@pytest.mark.parametrize("as_file", [False, True])
def test_matches_transformers(name, as_file, tiny_llama_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    from engine.tokenizer import Tokenizer

    model = _model_dir(tmp_path, tiny_llama_dir, _source(name), as_file=as_file)
    hf = AutoTokenizer.from_pretrained(str(model))
    ours = ChatTemplate.from_model_dir(model)
    tok = Tokenizer.from_dir(model)
    assert ours is not None
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            got = ours.render(conv, add_generation_prompt=gen)
            assert got == want
            want_ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
            if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
                want_ids = want_ids["input_ids"]
            assert tok.encode(got, add_special_tokens=False) == list(want_ids)


def test_template_refusal_is_a_clear_error(tiny_llama_dir, tmp_path) -> None:
    ours = ChatTemplate.from_model_dir(_model_dir(tmp_path, tiny_llama_dir, _source("mistral.jinja")))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.render([{"role": "assistant", "content": "first"}])


def test_named_templates_and_none(tiny_llama_dir, tmp_path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}D"}]
    ours = ChatTemplate.from_model_dir(_model_dir(tmp_path, tiny_llama_dir, named))
    assert ours.render([{"role": "user", "content": "x"}]) == "<|begin_of_text|>D"
    assert ChatTemplate.from_model_dir(_model_dir(tmp_path / "b", tiny_llama_dir, None)) is None


def test_jinja_file_wins_over_tokenizer_config(tiny_llama_dir, tmp_path) -> None:
    model = _model_dir(tmp_path, tiny_llama_dir, "FROM_CONFIG")
    (model / "chat_template.jinja").write_text("FROM_FILE", encoding="utf-8")
    assert ChatTemplate.from_model_dir(model).render([{"role": "user", "content": "x"}]) == "FROM_FILE"


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutation of what the server passed in
])
def test_sandbox_refuses_escapes(evil) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_bad_template_syntax_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_none_values_are_dropped_and_tojson_does_not_escape() -> None:
    t = ChatTemplate("{{ messages | tojson }}")
    assert t.render([{"role": "user", "content": "<a&b>", "name": None}]) == \
        '[{"role": "user", "content": "<a&b>"}]'


def test_model_init_writes_a_llama3_style_template(tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    ours = ChatTemplate.from_model_dir(tiny_llama_dir)
    assert ours is not None
    conv = CONVERSATIONS[2]
    text = ours.render(conv, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == text
