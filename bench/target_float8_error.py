"""How far `target.float8`'s features are from the full-precision ones, tap by tap, beside bf16's distance, on a
random-weight Qwen3-shaped target that fits a CPU (36 layers like Qwen3-8B, narrower). Runs anywhere:

    python3 bench/target_float8_error.py [--hidden 1024] [--length 256]

Prints one JSON line: the taps, and the relative norm of the difference to the fp32 features for bf16, float8
(fp32 model) and float8 of the bf16 model against bf16; and one linear layer's error alone (random input).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from dflash.components.float8 import frozen_float8_forward, target_float8
    from dflash.config import default_layer_ids
    from dflash.models.target import Target, build_hf_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--length", type=int, default=256)
    args = p.parse_args()
    h = args.hidden
    spec = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": h, "intermediate_size": 3 * h,
            "num_hidden_layers": 36, "num_attention_heads": h // 128, "num_key_value_heads": 2, "head_dim": 128}
    taps = default_layer_ids(36, 5)
    ids = torch.randint(0, 4096, (1, args.length), generator=torch.Generator().manual_seed(0))
    fp32 = build_hf_model(None, dict(spec), "float32", seed=0)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fp32_f8, bf16_f8 = copy.deepcopy(fp32), copy.deepcopy(bf16)  # copied before any hook is registered
    feats = {}
    for name, model, f8 in (("fp32", fp32, False), ("bf16", bf16, False), ("float8", fp32_f8, True),
                            ("float8_bf16", bf16_f8, True)):
        target = Target(model, taps)
        if f8:
            target_float8(target)
        feats[name] = target.features(ids).float()

    def rel(a: str, b: str) -> list[float]:
        x, y = feats[a], feats[b]
        return [round(float((x[..., i * h:(i + 1) * h] - y[..., i * h:(i + 1) * h]).norm()
                            / y[..., i * h:(i + 1) * h].norm()), 4) for i in range(len(taps))]

    torch.manual_seed(0)
    linear = torch.nn.Linear(h, h, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.02)
    x = torch.randn(256, h)
    with torch.no_grad():
        y = linear(x)
        one = {"float8": float((frozen_float8_forward(linear)(x) - y).norm() / y.norm()),
               "bf16": float(((x.bfloat16() @ linear.weight.bfloat16().t()).float() - y).norm() / y.norm())}
    print(json.dumps({"taps": taps, "hidden": h, "tokens": args.length, "bf16_vs_fp32": rel("bf16", "fp32"),
                      "float8_vs_fp32": rel("float8", "fp32"), "float8_of_bf16_vs_bf16": rel("float8_bf16", "bf16"),
                      "one_linear": {k: round(v, 4) for k, v in one.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
