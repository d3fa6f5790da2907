"""The trainer's drafter step with and without its CUDA graph (compile.step_graph), on the GPU machine.

Two trainers from one config and seed, one with `compile.step_graph=false` (kernel by kernel, the baseline)
and one with `compile.step_graph=true`, take the same steps in the same process; the script prints and writes
(--out DIR/step_graph.json) each one's losses, the median wall time of a step after the warm-up (synchronised),
how many steps were replayed from a graph and any capture failure. The losses must agree to bf16 rounding:
the graph holds the same kernels on the same inputs (its label rows padded with weight 0).

    python3 bench/step_graph_check.py CONFIG [--steps N] [--warmup N] [--out DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import load_config  # noqa: E402
from dflash.training.trainer import Trainer  # noqa: E402


def run(config_path: str, overrides: list[str], graph: bool, steps: int, warmup: int, out: Path) -> dict:
    name = "graph" if graph else "eager"
    cfg = load_config(config_path, [*overrides, f"output_dir={out / ('run-' + name)}",
                                    f"compile.step_graph={'true' if graph else 'false'}"])
    t = Trainer(cfg).setup()
    t.drafter.train()
    losses, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, res = t.train_step()  # reads the loss: one sync per step, as the trainer's loop
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    graphs = t.step_graphs
    return {"variant": name, "losses": losses, "step_ms_median": 1e3 * statistics.median(times) if times else None,
            "step_ms_all": [round(1e3 * x, 3) for x in times],
            "replayed_steps": graphs.replays if graphs else 0, "shapes_captured": len(graphs.graphs) if graphs else 0,
            "capture_failure": graphs.failed if graphs else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("/tmp/step-graph-check"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for graph in (False, True):
        torch.cuda.reset_peak_memory_stats()
        results.append(run(a.config, a.overrides, graph, a.steps, a.warmup, a.out))
        r = results[-1]
        print(f"{r['variant']}: step {r['step_ms_median']:.2f} ms (median of {len(r['step_ms_all'])}), "
              f"replayed {r['replayed_steps']}/{a.steps}, failure {r['capture_failure']}, "
              f"losses {[round(x, 4) for x in r['losses'][:5]]} ... {[round(x, 4) for x in r['losses'][-3:]]}",
              flush=True)
    eager, graph = results
    diff = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(eager["losses"], graph["losses"], strict=True))
    summary = {"config": a.config, "overrides": a.overrides, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "max_rel_loss_diff": diff,
               "speedup": (eager["step_ms_median"] / graph["step_ms_median"]
                           if eager["step_ms_median"] and graph["step_ms_median"] else None),
               "results": results}
    (a.out / "step_graph.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}), flush=True)


if __name__ == "__main__":
    main()
