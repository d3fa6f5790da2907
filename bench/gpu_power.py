"""The GPU's SM clock, power draw and clock-event reasons while a bench runs, read with nvidia-smi.

`GpuSampler()` starts a thread that asks nvidia-smi every ~50 ms; `window(t0, t1)` gives the medians of the
samples between two `time.time()` stamps and the clock-event reasons seen (0x4 is the software power cap);
`limits` holds the card's power limit (W) and maximum SM clock (MHz). Used by bench/target_forward.py
(gemm_sites) and bench/e2e_profile.py (the joules each sequence costs).
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time


def _query(fields: list[str]) -> tuple[int, list[str]]:
    done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True)
    return done.returncode, [x.strip() for x in done.stdout.strip().splitlines()[0].split(",")] if done.stdout else []


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class GpuSampler:
    """nvidia-smi's SM clock, power and active clock-event reasons of GPU 0, sampled in a thread."""

    FIELDS = ["clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active"]

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        self.fields = list(self.FIELDS)
        if _query(self.fields)[0] != 0:  # an older driver without the clock-event reasons
            self.fields = self.fields[:3]
        rc, limits = _query(["power.limit", "clocks.max.sm"])
        self.limits = {"power_limit_w": _number(limits[0]) if rc == 0 and limits else None,
                       "sm_clock_max_mhz": _number(limits[1]) if rc == 0 and len(limits) > 1 else None}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rc, values = _query(self.fields)
            if rc == 0:
                self.samples.append((time.time(), values))
            time.sleep(0.05)

    def window(self, t0: float, t1: float) -> dict:
        """Medians of the samples between `t0` and `t1` (time.time() stamps) and the reasons seen."""
        rows = [v for t, v in self.samples if t0 <= t <= t1 and len(v) == len(self.fields)]
        if not rows:
            return {"samples": 0}
        out: dict = {"samples": len(rows)}
        for i, name in enumerate(self.fields[:3]):
            numbers = [x for x in (_number(r[i]) for r in rows) if x is not None]
            out[name] = round(statistics.median(numbers), 1) if numbers else rows[-1][i]
        if len(self.fields) > 3:
            out["reasons"] = sorted({r[3] for r in rows})
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
