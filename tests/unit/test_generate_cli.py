import json
import os
import subprocess
import sys

import pytest

from engine.engine import EngineConfig, LLMEngine
from pdserve.app.cli import main
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def cli_json(capsys, *args) -> dict:
    assert main(["generate", *args, "--json", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # exactly one JSON object, nothing else on stdout
    return json.loads(out[0])


def test_prompt_ids_without_tokenizer_match_the_engine(capsys, make_checkpoint):
    model = make_checkpoint("llama", with_tokenizer=False)
    got = cli_json(capsys, "--model", str(model), "--prompt-ids", "5,6,7,8", "--max-tokens", "6",
                   "--ignore-eos")
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    assert engine.tokenizer is None
    want = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert got["token_ids"] == want
    assert engine.leak_report() is None
    assert "text" not in got and got["finish_reason"] == "length" and got["num_prompt_tokens"] == 4


def test_prompt_text_json_has_text_and_sampling_is_seeded(capsys, tiny_llama_dir):
    args = ["--model", str(tiny_llama_dir), "--prompt", "The quick brown fox", "--max-tokens", "8",
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "11", "--ignore-eos"]
    first = cli_json(capsys, *args)
    assert len(first["token_ids"]) == 8 and isinstance(first["text"], str)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu"))
    assert first["text"] == engine.tokenizer.decode(first["token_ids"])
    assert engine.leak_report() is None
    assert cli_json(capsys, *args) == first  # same seed, same tokens


def test_stop_string(capsys, tiny_llama_dir):
    base = cli_json(capsys, "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "20",
                    "--ignore-eos")
    text = base["text"]
    stop = text[len(text) // 2:len(text) // 2 + 1]
    got = cli_json(capsys, "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "20",
                   "--ignore-eos", "--stop", stop, "zzz-never")
    assert got["finish_reason"] == "stop" and got["text"] == text[:text.index(stop)]


def test_clear_errors(capsys, make_checkpoint, tmp_path):
    no_tok = make_checkpoint("llama", with_tokenizer=False)
    assert main(["generate", "--model", str(no_tok), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(no_tok), "--prompt-ids", "1,x", "--device", "cpu"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--model", str(no_tok), "--prompt-ids", "1", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(no_tok), "--prompt-ids", "99999", "--device", "cpu"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_console_script_prints_an_answer(tiny_llama_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "generate",
                           "--model", str(tiny_llama_dir),
                           "--prompt", "The quick brown fox", "--max-tokens", "5", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "5 tokens" in proc.stderr


def test_prompt_flags_are_exclusive_and_required(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x"])
    assert "one of the arguments --prompt --prompt-ids is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x", "--prompt", "a", "--prompt-ids", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_structured_output_flags(capsys, tiny_llama_dir, tmp_path):
    import re

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "additionalProperties": False, "required": ["n"],
                                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}))
    out = cli_json(capsys, "--model", str(tiny_llama_dir), "--prompt", "hi", "--json-schema", f"@{schema}")
    assert out["finish_reason"] == "stop" and 0 <= json.loads(out["text"])["n"] <= 9
    out = cli_json(capsys, "--model", str(tiny_llama_dir), "--prompt", "hi", "--choice", "yes",
                   "--choice", "no")
    assert out["text"] in ("yes", "no")
    out = cli_json(capsys, "--model", str(tiny_llama_dir), "--prompt", "hi", "--regex", "[a-c]{3}")
    assert re.fullmatch("[a-c]{3}", out["text"])
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--regex", "([0-9"]) == 2
    assert "cannot be compiled" in capsys.readouterr().err
