"""Regeneration decode-step cost of the real target's shape, eager against compiled (docs/PERFORMANCE.md).

A random-weight model of the converted target's config (so that no answer ends early: every row decodes NEW
tokens) answers the first prompts of a pool through dflash's transformers backend, batch B, every prompt padded
to 256 tokens (one shape): one eager pass, then three compiled passes (the first ones compile).
    python3 bench/regen_compile_probe.py TARGET_DIR POOL.jsonl [NEW]     # TARGET_DIR: config + tokenizer
On a CPU it runs 4 prompts a batch (a check that it runs, not a measurement).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash.regenerate.core import SamplingParams  # noqa: E402
from dflash.regenerate.hf import TransformersBackend  # noqa: E402


def main(target: str, pool: str, new: int = 96) -> None:
    cuda = torch.cuda.is_available()
    batch = 512 if cuda else 4
    config, tokenizer = AutoConfig.from_pretrained(target), AutoTokenizer.from_pretrained(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to("cuda" if cuda else "cpu").eval()
    with open(pool) as f:
        rows = [json.loads(line)["messages"] for _, line in zip(range(3 * batch), f, strict=False)]
    params = SamplingParams(max_new_tokens=new, max_prompt_tokens=256)
    for compiled, passes in ((False, 1), (True, 3)):
        backend = TransformersBackend(model, tokenizer, batch_size=batch, pad_to_multiple_of=256, compile=compiled)
        for k in range(passes):
            t0 = time.perf_counter()
            replies = backend.generate(rows[batch * k:batch * (k + 1)], params)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tokens = sum(r.new_tokens for r in replies if r.text is not None)
            print(f"{'compiled' if compiled else 'eager'} pass {k}: {dt:.1f} s, {tokens} tokens, {tokens / dt:.0f} "
                  f"tokens/s, {dt / new * 1000:.1f} ms a step (batch {batch})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
