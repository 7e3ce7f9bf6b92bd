"""When should a CPU packing stop? Per-weight packing times from fresh processes, replayed through stop rules.

    python benchmarks/packing_clock.py CKPT [CKPT ...] --runs 4 --log clock.jsonl   # record, then replay
    python benchmarks/packing_clock.py --replay clock.jsonl --budget 3.07 --budget-size 4.13e9

Each run loads a checkpoint as fp32 in a new process (a bf16 one is upcast, as the resolver's fp32
choice loads it), runs one batch-4 prompt, and packs every linear weight with no budget, logging
when each weight finished (``packed_weights._Clock.add``). The replay then asks, for each
run and each rule, where a packing with the given budget (scaled by the copy's size for other
models) would have stopped, and what the job would have cost: ``--job-s`` seconds unpacked, less
``--gain-s`` for the whole copy packed, in proportion to the bytes packed, plus the time spent
packing. Printed as the best of (unpacked, packed whole) over that, per run, so 1.00 is the best
and above 1 a stop whose packed part repaid. The rules: the clock as built (the whole copy at the
rate after the first weight, from 1% of it), the one before (3% after the first weight of each
shape), and the time so far plus the rest (the rule before that).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

RECORD = """
import json, sys, torch, transformers
transformers.utils.logging.set_verbosity_error()
from whichdevice.tuning import packed_weights as pw
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.randint(3, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    model(ids)
log, add = [], pw._Clock.add
def logged(self, size):
    price = add(self, size)
    log.append([size, pw.time.perf_counter() - self.start])
    return price
pw._Clock.add = logged
pw.install_packed_weights(model, "float32", 4)
shapes = [list(m.weight.shape) for m in pw.packable_layers(model, "float32")]
print(json.dumps({"log": [[s, *row] for s, row in zip(shapes, log)]}))
"""


def record(path: str) -> list[list[Any]]:
    """One fresh process's packing of ``path``: [shape, bytes, seconds since the start] per weight."""
    out = subprocess.run([sys.executable, "-c", RECORD, path], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"recording {path} failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return list(json.loads(lines[-1])["log"])


def built(log: list[list[Any]]) -> list[float | None]:
    """The clock as built: ``packed_weights._Clock`` itself, its clock read from the recorded times."""
    import types

    from whichdevice.tuning import packed_weights

    times = iter([0.0] + [row[2] for row in log])
    real = packed_weights.time
    packed_weights.time = types.SimpleNamespace(perf_counter=lambda: next(times))  # type: ignore[assignment]
    try:
        clock = packed_weights._Clock(sum(row[1] for row in log))
        return [clock.add(row[1]) for row in log]
    finally:
        packed_weights.time = real


def per_shape(log: list[list[Any]], share: float = 0.03, spent: bool = False) -> list[float | None]:
    """The rate of weights whose shape was packed before; ``spent``: the time so far plus the rest."""
    size = sum(row[1] for row in log)
    seen: set[tuple[int, ...]] = set()
    steady_b, steady_s, last, done, prices = 0, 0.0, 0.0, 0, []
    for shape, nbytes, t in log:
        if tuple(shape) in seen:
            steady_b, steady_s = steady_b + nbytes, steady_s + t - last
        seen.add(tuple(shape))
        last, done = t, done + nbytes
        if steady_b < share * size or steady_s < 0.05:
            prices.append(None)
        else:
            rate = steady_s / steady_b
            prices.append(t + (size - done) * rate if spent else size * rate)
    return prices


RULES = {
    "whole copy, 1% after the first weight (built)": built,
    "whole copy, 3% after each shape's first": lambda log: per_shape(log),
    "time so far plus the rest, 3% after each shape's first": lambda log: per_shape(log, spent=True),
}


def replay(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for name, rule in RULES.items():
        print(f"== {name}")
        ratios = []
        for run in runs:
            log = run["log"]
            size = sum(row[1] for row in log)
            scale = size / args.budget_size
            job, gain, budget, total = args.job_s * scale, args.gain_s * scale, args.budget * scale, log[-1][2]
            prices = rule(log)
            stop = next((i for i, p in enumerate(prices) if p is not None and p > budget), None)
            if stop is None:
                spent, packed = total, size
            else:
                spent, packed = log[stop][2], sum(row[1] for row in log[: stop + 1])
            ratio = min(job, job - gain + total) / (job - gain * packed / size + spent)
            ratios.append(ratio)
            where = "whole" if stop is None else f"stopped at {packed / size:.0%} ({spent:.2f} s)"
            print(f"  {run['name']:<28} packing {total:5.2f} s, budget {budget:5.2f} s: {where:<26} {ratio:.2f}")
        print(f"  lowest {min(ratios):.2f}, mean {sum(ratios) / len(ratios):.3f} of the best")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--log", type=Path, help="append the recorded runs here (JSON lines)")
    parser.add_argument("--replay", type=Path, help="replay the runs recorded in this file instead")
    parser.add_argument("--budget", type=float, default=3.07, help="seconds, for a copy of --budget-size bytes")
    parser.add_argument("--budget-size", type=float, default=4.13e9)
    parser.add_argument("--job-s", type=float, default=6.13, help="the job unpacked, at --budget-size")
    parser.add_argument("--gain-s", type=float, default=4.0, help="what the whole copy saves, at --budget-size")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    if args.replay:
        runs = [json.loads(line) for line in args.replay.read_text().splitlines() if line.strip()]
    for path in args.checkpoints:
        for i in range(args.runs):
            run = {"name": f"{Path(path).name} #{i + 1}", "log": record(path)}
            print(f"recorded {run['name']}: {run['log'][-1][2]:.2f} s", flush=True)
            runs.append(run)
            if args.log:
                with args.log.open("a") as f:
                    f.write(json.dumps(run) + "\n")
    replay(runs, args)


if __name__ == "__main__":
    main()
