"""Run `dflash train` with a Python stack dump every N seconds: where a slow start spends its time.

    python3 bench/stack_trace_run.py STACKS_FILE INTERVAL_S CONFIG [OVERRIDES...]

Each dump (faulthandler, all threads) is appended to STACKS_FILE; run it under `timeout` and read the
dumps in order (model load, data, target forward, torch.compile tracing, inductor code generation...).
"""

import faulthandler
import sys

from dflash.cli import main

if __name__ == "__main__":
    path, interval = sys.argv[1], float(sys.argv[2])
    stacks = open(path, "w", buffering=1)  # noqa: SIM115 (open for the whole run)
    faulthandler.dump_traceback_later(interval, repeat=True, file=stacks)
    sys.exit(main(["train", *sys.argv[3:]]))
