"""Does the same machine give the same decision from fresh calibrations, quiet and at load 2? (issue 27)

    python benchmarks/calibration_repeat.py MODEL_DIR [MODEL_DIR ...] --runs 10 --load 2

Each run is a fresh process with an empty calibration cache: its first ``resolve_device`` measures
the CPU (as a user's first call does), then it resolves every model at batch 1 and 4 (max_length
64) and at batch 4 with max_length 1024 (long enough for packed weights to pay). ``--load N`` keeps
N busy-looping processes running meanwhile (pure Python, one core each), so that the machine's load
average is about N on top of the calibration's own threads. The decision of a cell is what
from_pretrained and generate get: dtype, attention, the single-row setting and the packed weights.
Prints each run's calibration verdict and decisions, then per cell how many runs agree with the
most common decision.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def child(models: list[str]) -> None:
    import whichdevice as wd

    start = time.perf_counter()
    cells: dict[str, Any] = {}
    for model in models:
        # A long batch-4 job too: packed weights pay only over enough new tokens.
        for batch, length in ((1, 64), (4, 64), (4, 1024)):
            res = wd.resolve_device(model=model, batch_size=batch, max_length=length)
            label = f"{res.dtype_name}/{res.attn_implementation}" + (
                "+single_row" if (res.tuning is not None and res.tuning.single_row) else ""
            )
            cells[f"{os.path.basename(model)} b{batch} x{length}"] = label + (
                "+packed" if (res.tuning is not None and res.tuning.packed_for_batch) else ""
            )
            calibration = next(s.message for s in res.trace if s.topic == "calibration")
    print(
        json.dumps(
            {
                "cells": cells,
                "calibration": calibration[:300],
                "seconds": round(time.perf_counter() - start, 2),
                "load": os.getloadavg()[0],
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.models)
        return 0
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    if spinners:
        time.sleep(30)  # let the 1-minute load average climb towards the load asked for
    runs = []
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="whichdevice-repeat-") as cache:
                env = {**os.environ, "WHICHDEVICE_CALIBRATION": cache}
                out = subprocess.run(
                    [sys.executable, __file__, *args.models, "--child"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(row)
            print(f"run {i + 1}: load {row['load']:.2f}, {row['seconds']} s: {row['cells']}", flush=True)
            print(f"    calibration: {row['calibration']}", flush=True)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    print(f"\nagreement over {len(runs)} fresh calibrations at --load {args.load}:")
    for cell in runs[0]["cells"]:
        counts = collections.Counter(r["cells"][cell] for r in runs)
        decision, n = counts.most_common(1)[0]
        others = ", ".join(f"{d} x{c}" for d, c in counts.items() if d != decision)
        print(f"  {cell:24} {n}/{len(runs)} {decision}" + (f" (others: {others})" if others else ""))
    unsteady = sum("could not be timed steadily" in r["calibration"] for r in runs)
    print(f"  calibrations not steady (the CPU's flags decided): {unsteady}/{len(runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
