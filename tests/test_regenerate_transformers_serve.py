"""`dflash regenerate --server` against a third-party OpenAI-compatible server that runs on a CPU: `transformers
serve` (the transformers release's own server, FastAPI + uvicorn) serving a tiny random-weight Qwen3 with a
byte-level BPE tokenizer and a Qwen-format chat template, saved by this test. Greedy answers through the server
must be byte for byte the local transformers backend's. (This caught a 422 on vLLM's `skip_special_tokens` with
transformers 5.24: tests/test_regenerate.py covers that refusal with the stub server, whatever a later release does.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.data.synthetic import generate_conversations

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS = Path(sys.executable).parent / "transformers"
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

pytestmark = pytest.mark.skipif(not TRANSFORMERS.exists(), reason="the transformers CLI is not in the venv (make venv)")


def save_target(path: Path) -> None:
    """A tiny Qwen3 (random weights, the tiny config's shape) and a byte-level BPE tokenizer trained on the
    synthetic counting language, whose text round-trips exactly (what a real tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash.config import load_config
    from dflash.models.target import build_hf_model

    corpus = [m["content"] for r in generate_conversations(200, 64, 4, 10, [1, 2], seed=3) for m in r["messages"]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = QWEN_TEMPLATE
    t = load_config(ROOT / "configs" / "tiny-cpu.yaml", []).target
    model = build_hf_model(None, {**t.random_init, "vocab_size": len(tok)}, "float32", t.attn_implementation, seed=0)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    target = tmp_path / "target"
    save_target(target)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([str(TRANSFORMERS), "serve", str(target), "--device", "cpu", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600  # a liveness bound: a loaded machine imports FastAPI and torch slowly
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as answer:
                    if json.loads(answer.read())["data"]:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield target, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_answers_through_transformers_serve_are_the_local_backends(tmp_path, served):
    target, url = served
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in generate_conversations(6, 64, 4, 10, [1, 2], seed=7)))
    local, remote = tmp_path / "local.jsonl", tmp_path / "served.jsonl"
    common = ["--target-path", str(target), "--max-new-tokens", "8"]
    assert main(["regenerate", str(inp), str(local), *common]) == 0
    assert main(["regenerate", str(inp), str(remote), *common, "--server", url, "--concurrency", "2"]) == 0
    assert remote.read_bytes() == local.read_bytes()
    manifest = json.loads((tmp_path / "served.jsonl.manifest.json").read_text())
    assert manifest["backend"]["model"] == str(target) and manifest["counts"]["regenerated_turns"] == 6
