"""GPU measurement of the recipe's two inference paths: regeneration throughput and the eval's verify step.

Usage (on the GPU machine):  python bench/recipe_bench.py --out DIR [--sections baseline,backend,verify]
Validate on a CPU first:      python bench/recipe_bench.py --tiny --out /tmp/rb

* baseline: plain transformers `generate` on a Qwen3-8B-shaped random target, batch 128, prompt 256, 256 new
  tokens, greedy: the default cache and `cache_implementation="static"` (the issue's reference numbers);
* backend: dflash's transformers regeneration backend on ragged prompts (64..512 tokens, uniform), 256 new
  tokens, at several batch sizes: output tokens/s (EOS suppressed so every row generates its 256 tokens,
  like the baseline);
* verify: the speculative-decoding eval's costs at a 1024-token context: one target verify forward of a
  16-token block (+ rollback), one plain decode step, and one drafter proposal (5 layers, Qwen3-8B width).
Each section appends to DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import QWEN3_8B, TINY_DENSE, build, device, sync  # noqa: E402

OUT = Path(".")


def record(section: str, data: dict) -> None:
    path = OUT / "results.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[section] = data
    path.write_text(json.dumps(merged, indent=2))
    print(f"[{section}] {json.dumps(data)}", flush=True)


def sec_baseline(model, args):
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    ids = torch.randint(100, vocab - 100, (args.batch, args.prompt), device=device())
    out = {}
    for name, kwargs in (("default_cache", {}), ("static_cache", {"cache_implementation": "static"})):
        def run():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                  min_new_tokens=args.new, do_sample=False, pad_token_id=0, **kwargs)
        run()  # warm-up (static cache: compiles)
        sync()
        t0 = time.perf_counter()
        res = run()
        sync()
        dt = time.perf_counter() - t0
        new = (res.shape[1] - args.prompt) * args.batch
        out[name] = {"batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "seconds": dt,
                     "tokens_per_s": new / dt}
    record("baseline_generate", out)


def _ragged_conversations(n: int, lo: int, hi: int, words: int, seed: int = 0):
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        text = " ".join(f"w{rng.randrange(words)}" for _ in range(length))
        convs.append([{"role": "user", "content": text}, {"role": "assistant", "content": "x"}])
    return convs


def sec_backend(model, args):
    from dflash.data.synthetic import build_tokenizer
    from dflash.regenerate import SamplingParams, TransformersBackend, regenerate_conversations

    tok = build_tokenizer(min(4096, model.config.vocab_size - 100))
    results = {}
    variants = [v for v in args.variants.split(",") if v]
    for bs in args.backend_batches:
        for variant in variants:
            convs = _ragged_conversations(bs * args.rounds, args.min_prompt, args.max_prompt, len(tok) - 30, seed=bs)
            params = SamplingParams(max_new_tokens=args.new)
            compiled = "compile" in variant
            backend = TransformersBackend(model, tok, batch_size=bs, compile=compiled,
                                          pad_to_multiple_of=args.max_prompt if compiled else None)
            backend.stop_ids = []  # every row generates max_new_tokens, as in the baseline
            if "nosuppress" in variant:  # the synthetic tokenizer forbids ~148k of 152k ids; a real one ~270
                backend.suppress = None
            regenerate_conversations(convs[:bs], backend, params)  # warm-up / compile
            sync()
            t0 = time.perf_counter()
            _, stats = regenerate_conversations(convs, backend, params)
            sync()
            dt = time.perf_counter() - t0
            gen = getattr(stats, "generated_tokens", None)
            key = f"{bs}/{variant}"
            results[key] = {"prompts": len(convs), "seconds": dt, "generated_tokens": gen,
                            "tokens_per_s": (gen or 0) / dt, "prompt_tokens": f"{args.min_prompt}..{args.max_prompt}"}
            print(key, results[key], flush=True)
    record("backend_regenerate", results)


def sec_verify(model, args):
    from dflash.models.drafter import Drafter, arch_from_target
    from dflash.models.target import Target
    from dflash.speculative import DrafterSession, TargetSession

    layer_ids = [1, 9, 17, 25, 33] if model.config.num_hidden_layers >= 34 else [1, 3, 5]
    target = Target(model, layer_ids)
    arch = arch_from_target(model.config, num_layers=5, block_size=16, layer_ids=layer_ids,
                            mask_token_id=5, vocab_size=model.config.vocab_size)
    drafter = Drafter(arch).to(device(), torch.bfloat16).eval()
    prompt = torch.randint(100, model.config.vocab_size - 100, (args.context,), device=device())
    sess = TargetSession(target)
    token, _, feats = sess.prefill(prompt)
    dsess = DrafterSession(drafter, target)
    dsess.append(feats)
    block = torch.randint(100, min(1000, model.config.vocab_size), (16,), device=device())

    def verify_and_rollback():
        start = sess.length
        _, _, snap = sess.verify(block)
        sess.rollback(start + 1, block, snap)
        # undo the committed token as well, so every call sees the same context
        sess._crop_attention(start)

    def step():
        sess.step(token)
        sess._crop_attention(sess.length - 1)

    def propose():
        dsess.propose(token, None)

    out = {"context": args.context, "block": 16}
    for name, fn in (("verify_ms", verify_and_rollback), ("decode_step_ms", step), ("draft_ms", propose)):
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        out[name] = (time.perf_counter() - t0) / args.iters * 1e3
    out["verify_over_step"] = out["verify_ms"] / out["decode_step_ms"]
    out["round_ms"] = out["verify_ms"] + out["draft_ms"]
    out["break_even_acceptance"] = out["round_ms"] / out["decode_step_ms"]
    record("eval_verify", out)


def main() -> int:
    global OUT
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="baseline,backend,verify")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--backend-batches", default="64,128,256,384")
    p.add_argument("--variants", default="plain,nosuppress,nosuppress+compile",
                   help="backend settings measured per batch size")
    p.add_argument("--rounds", type=int, default=2, help="batches of prompts per backend measurement")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    args.backend_batches = [int(x) for x in args.backend_batches.split(",")]
    if args.tiny:
        args.batch, args.prompt, args.new, args.backend_batches = 4, 16, 8, [4]
        args.min_prompt, args.max_prompt, args.context, args.iters = 8, 24, 64, 3
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    spec = dict(TINY_DENSE if args.tiny else QWEN3_8B)
    model = build(spec, torch.float32 if args.tiny else torch.bfloat16)
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "spec": "tiny" if args.tiny else "qwen3-8b"}
    import transformers

    info["transformers"] = transformers.__version__
    record("machine", info)
    for name in args.sections.split(","):
        try:
            {"baseline": sec_baseline, "backend": sec_backend, "verify": sec_verify}[name](model, args)
        except Exception as exc:  # one failing section must not lose the others
            import traceback

            traceback.print_exc()
            record(f"{name}_error", {"error": repr(exc)[:500]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
