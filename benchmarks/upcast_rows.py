"""Where does a bf16 linear forward run faster in fp32 from its weights, and does the calibration find it? (issue 56)

    python benchmarks/upcast_rows.py                         # native and AVX2-capped; about a minute
    python benchmarks/upcast_rows.py --kinds avx2 --rounds 15

For each kind of CPU (``native``; ``avx2``: oneDNN and ATen held to AVX2, as an AVX2-only CPU runs) a
child process times one linear layer of a 1.1B Llama's MLP (a 5632 x 2048 weight) at each row count,
three ways, in interleaved rounds (the best of each kept):

- ``bf16``: bf16 input, bf16 weight, torch's linear (what a bf16 load runs);
- ``upcast``: as ``prepare()`` runs a bf16 load's forwards above ``res.tuning.upcast_above``: the bf16
  weight copied into one reused fp32 buffer, an fp32 linear, the result rounded to bf16;
- ``fp32``: fp32 input and weight (what an fp32 load runs);

then calibrates (an empty cache) and prints the crossover ``measure.estimate.upcast_rows`` reads from
its figures beside the one measured here: the first row count from which ``upcast`` beats ``bf16``.

``--overhead``: what the per-layer check costs the calls it passes on (decode steps): greedy generate
of 8 + 128 tokens by the 0.1B and 0.4B Llamas in bf16 (real_sizes.py's), one model with the setting
installed and taken off in alternated rounds, in this process (no cap); the median of the per-round
ratios, and the tokens equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import harness

KINDS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
ROWS = (1, 4, 8, 12, 16, 24, 32, 64, 128, 512)
SHAPE = (5632, 2048)


def child(rounds: int) -> dict[str, Any]:
    import torch

    from whichdevice.measure.calibration import run_calibration
    from whichdevice.measure.estimate import upcast_rows

    torch.manual_seed(0)
    weight = torch.empty(*SHAPE).uniform_(-0.03, 0.03)
    bf16, buffer = weight.bfloat16(), torch.empty(*SHAPE)
    linear = torch.nn.functional.linear
    table: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, SHAPE[1])
            half = x.bfloat16()
            runs = {
                "bf16": lambda half=half: linear(half, bf16),
                "upcast": lambda half=half: linear(half.float(), buffer.copy_(bf16)).bfloat16(),
                "fp32": lambda x=x: linear(x, weight),
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for run in runs.values():
                run()
            for _ in range(rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            table[rows] = {name: min(t) * 1e3 for name, t in times.items()}
        copy = min(_timed(lambda: buffer.copy_(bf16)) for _ in range(rounds)) * 1e3
    calib = run_calibration()
    measured = next((rows for rows in ROWS if table[rows]["upcast"] < table[rows]["bf16"]), None)
    return {
        "ms": table,
        "copy_ms": copy,
        "calibrated_rows": upcast_rows(calib),
        "first_faster_rows": measured,
        "figures": {k: v for k, v in calib.speeds.items() if k in ("bf16.prompt", "bf16.up", "bf16.s4")},
        "upcast_gbps": calib.memory.get("upcast"),
        "unsteady": list(calib.unsteady),
        "threads": torch.get_num_threads(),
        "uptime": harness.uptime(),
    }


def overhead(rounds: int) -> None:
    import torch

    from whichdevice.tuning.upcast import install_upcast, remove_upcast

    harness.quiet_transformers()
    for size in ("0.1B", "0.4B"):
        model = harness.build_model(**harness.llama(size)).to(torch.bfloat16)
        ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"plain": [], "installed": []}
        tokens = {}
        for r in range(rounds + 1):
            for name in ("plain", "installed") if r % 2 else ("installed", "plain"):
                if name == "installed":
                    install_upcast(model, 21)
                seconds, out = harness.generate(model, ids, 128, True)
                remove_upcast(model)
                tokens[name] = out
                if r:  # the first round builds oneDNN's kernels
                    times[name].append(seconds)
        ratios = sorted(p / i for p, i in zip(times["plain"], times["installed"], strict=True))
        same = torch.equal(tokens["plain"], tokens["installed"])
        print(
            f"{size} bf16, 8 + 128 tokens, {rounds} alternated rounds: installed {ratios[len(ratios) // 2]:.3f}x the "
            f"plain model's speed (range {ratios[0]:.3f}-{ratios[-1]:.3f}), tokens equal: {same}; {harness.uptime()}",
            flush=True,
        )


def _timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def table(kind: str, got: dict[str, Any]) -> str:
    lines = [
        f"## {kind}: one {SHAPE[0]} x {SHAPE[1]} weight, {got['threads']} threads, best of the rounds; {got['uptime']}",
        "| rows | bf16 ms | upcast ms (copy + fp32 + round) | fp32 weights ms | upcast / bf16 |",
        "|---|---|---|---|---|",
    ]
    for rows, ms in got["ms"].items():
        lines.append(
            f"| {rows} | {ms['bf16']:.2f} | {ms['upcast']:.2f} | {ms['fp32']:.2f} | {ms['bf16'] / ms['upcast']:.2f}x |"
        )
    lines.append(
        f"copy alone {got['copy_ms']:.2f} ms; upcast first faster at {got['first_faster_rows']} rows; the "
        f"calibration's crossover: forwards of more than {got['calibrated_rows']} rows (figures {got['figures']}, "
        f"copy {got['upcast_gbps']} GB/s, unsteady {got['unsteady']})"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=str(harness.RESULTS / "upcast_rows.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overhead", action="store_true", help="the check's cost on decode steps, in this process")
    args = parser.parse_args()
    if args.overhead:
        overhead(args.rounds)
        return 0
    if args.child:
        print(json.dumps(child(args.rounds)))
        return 0
    machine = harness.machine()
    print(harness.machine_line(machine), flush=True)
    report = {}
    for kind in args.kinds:
        with tempfile.TemporaryDirectory(prefix="whichdevice-calibration-") as cache:
            env = {**os.environ, **KINDS[kind], "WHICHDEVICE_CALIBRATION": cache}
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                check=True,
            )
        got = json.loads(out.stdout.splitlines()[-1])
        got["ms"] = {int(k): v for k, v in got["ms"].items()}
        report[kind] = got
        print(table(kind, got), flush=True)
    harness.write_json(args.json, {"machine": machine, "kinds": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
