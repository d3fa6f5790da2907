"""GPU measurement of the recipe's two inference paths: regeneration throughput and the eval's verify step.

Usage (on the GPU machine):  python bench/recipe_bench.py --out DIR [--sections baseline,padded,backend,verify]
Validate on a CPU first:      python bench/recipe_bench.py --tiny --out /tmp/rb

* baseline: plain transformers `generate` on a Qwen3-8B-shaped random target, batch 128, prompt 256, 256 new
  tokens, greedy: the default cache and `cache_implementation="static"` (the issue's reference numbers);
* padded: plain `generate` (static cache, compiled by transformers) on the same ragged prompts, left-padded
  per batch: what transformers alone does with them;
* backend: dflash's transformers regeneration backend on ragged prompts (64..512 tokens, uniform), 256 new
  tokens, at several batch sizes and settings (--variants): output tokens/s of a second pass over the
  prompts (the first compiles; its time is reported too; EOS suppressed so every row generates its 256
  tokens, like the baseline);
* verify: the speculative-decoding eval's costs at a 1024-token context: one target verify forward of a
  16-token block (+ rollback), one plain decode step, and one drafter proposal (5 layers, Qwen3-8B width).
Each section appends to DIR/results.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import QWEN3_8B, TINY_DENSE, build, device, sync  # noqa: E402
from bench.lib import record as record_section  # noqa: E402

OUT = Path(".")


def record(section: str, data: dict) -> None:
    record_section(OUT / "results.json", section, data)


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


BACKEND_VARIANTS = {
    # name: (TransformersBackend keywords, attributes set after construction)
    "default": ({}, {}),  # what `dflash regenerate` runs: compiled on CUDA, widths to 64, cache per batch
    "repeatkv": ({}, {"gqa_decode": False}),  # transformers' sdpa: K/V copied per query head each step
    "eager": ({"compile": False}, {}),
    "pad512": ({"compile": True, "pad_to_multiple_of": 512}, {}),  # the 2026-12-01 call-3 setting
    "continuous": ({"batching": "continuous"}, {}),
    "refill": ({"batching": "refill"}, {}),  # finished rows replaced once half the batch is done
}


def _timed_regenerate(convs, backend, params):
    from dflash.regenerate import regenerate_conversations

    sync()
    t0 = time.perf_counter()
    _, stats = regenerate_conversations(convs, backend, params)
    sync()
    return time.perf_counter() - t0, stats


def sec_backend(model, args):
    """dflash's backend on ragged prompts; the first pass over the prompt set compiles (its time is the
    `first_pass_s`), the second is timed (steady state). EOS is off, so every row generates args.new tokens."""
    from dflash.data.synthetic import build_tokenizer
    from dflash.regenerate import SamplingParams, TransformersBackend

    tok = build_tokenizer(min(4096, model.config.vocab_size - 100))
    results = {}
    vocab = model.config.vocab_size  # the random target generates from all of it (suppression off below)
    stop_ids = (sorted(random.Random(5).sample(range(100, vocab), max(1, round(args.stop_share * vocab))))
                if args.stop_share else [])
    for bs in args.backend_batches:
        convs = _ragged_conversations(bs * args.rounds, args.min_prompt, args.max_prompt, len(tok) - 30, seed=bs)
        for spec in [v for v in args.variants.split(",") if v]:
            variant, _, only = spec.partition("@")  # "name@128": this variant at batch 128 only
            if only and int(only) != bs:
                continue
            kwargs, attrs = BACKEND_VARIANTS[variant]
            params = SamplingParams(max_new_tokens=args.new)
            backend = TransformersBackend(model, tok, batch_size=bs, **kwargs)
            for k, v in attrs.items():
                setattr(backend, k, v)
            # EOS off: every row generates max_new_tokens, as in the baseline; --stop-share: a random share of
            # the ids stops an answer, so lengths are uneven (geometric, mean ~1/share, capped at --new)
            backend.stop_ids = stop_ids
            backend.suppress = None  # the synthetic tokenizer forbids ~148k of 152k ids; a real one ~270
            try:
                first, _ = _timed_regenerate(convs, backend, params)
                dt, stats = _timed_regenerate(convs, backend, params)
                gen = stats.generated_tokens
            except Exception as exc:  # one variant failing must not lose the others
                results[f"{bs}/{variant}"] = {"error": repr(exc)[:300]}
                print(f"{bs}/{variant} failed: {exc!r}", flush=True)
                continue
            key = f"{bs}/{variant}"
            results[key] = {"prompts": len(convs), "stop_ids": len(stop_ids), "max_new_tokens": args.new,
                            "first_pass_s": round(first, 2), "seconds": round(dt, 2),
                            "generated_tokens": gen, "tokens_per_s": round(gen / dt, 1),
                            "answers_at_max_new_tokens": stats.hit_max_new_tokens,
                            "prompt_tokens": f"{args.min_prompt}..{args.max_prompt}",
                            "describe": {k: v for k, v in backend.describe().items()
                                         if k in ("compiled_decoding", "kv_cache", "batching")}}
            print(key, results[key], flush=True)
            record("backend_regenerate", results)
            if args.profile and variant == args.profile:
                _profile(convs[:bs], backend, SamplingParams(max_new_tokens=32))


def _profile(convs, backend, params):
    """The top CUDA kernels of one batch with 32 new tokens (after the timed passes: shapes compiled)."""
    from torch.profiler import ProfilerActivity, profile

    from dflash.regenerate import regenerate_conversations

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        regenerate_conversations(convs, backend, params)
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
                                      row_limit=18, max_name_column_width=70)
    (OUT / "profile.txt").write_text(table)
    print(table, flush=True)


def sec_padded(model, args):
    """Plain `model.generate` (static cache, compiled by transformers) on the backend's ragged prompts,
    left-padded per batch of similar lengths: what transformers alone does with these prompts."""
    from dflash.data.synthetic import build_tokenizer

    tok = build_tokenizer(min(4096, model.config.vocab_size - 100))
    bs = args.batch
    convs = _ragged_conversations(bs * args.rounds, args.min_prompt, args.max_prompt, len(tok) - 30, seed=bs)
    from dflash.regenerate import SamplingParams
    from dflash.regenerate.hf import render_prompt

    prompts = sorted((render_prompt(tok, c[:1], SamplingParams()) for c in convs), key=len, reverse=True)
    batches = []
    for s in range(0, len(prompts), bs):
        chunk = prompts[s:s + bs]
        width = -(-max(len(p) for p in chunk) // 64) * 64
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        batches.append((ids.to(device()), mask.to(device())))

    def run():
        n = 0
        for ids, mask in batches:
            model._previous_max_cache_length = -1  # each batch's own cache length, as the backend does
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                 do_sample=False, pad_token_id=0, cache_implementation="static")
            n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return n

    sync()
    t0 = time.perf_counter()
    run()
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = run()
    sync()
    dt = time.perf_counter() - t0
    record("padded_generate", {"batch": bs, "prompts": len(prompts), "first_pass_s": round(first, 2),
                               "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1),
                               "widths": [int(b[0].shape[1]) for b in batches]})


def sec_verify(model, args):
    from dflash.evaluation.speculative import DrafterSession, TargetSession
    from dflash.models.drafter import Drafter, arch_from_target
    from dflash.models.target import Target

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
    p.add_argument("--sections", default="baseline,padded,backend,verify")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--backend-batches", default="64,128,256,384")
    p.add_argument("--variants", default="default,repeatkv,continuous",
                   help=f"backend settings measured per batch size: {', '.join(BACKEND_VARIANTS)}")
    p.add_argument("--profile", default=None, metavar="VARIANT",
                   help="profile one short batch of this backend variant (top kernels to profile.txt)")
    p.add_argument("--stop-share", type=float, default=0.0,
                   help="backend: this share of the tokenizer's ids ends an answer (uneven lengths; 0: EOS off)")
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
            {"baseline": sec_baseline, "padded": sec_padded, "backend": sec_backend,
             "verify": sec_verify}[name](model, args)
        except Exception as exc:  # one failing section must not lose the others
            import traceback

            traceback.print_exc()
            record(f"{name}_error", {"error": repr(exc)[:500]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
