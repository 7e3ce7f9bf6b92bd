"""Two checkouts' fresh ``resolve_device()`` side by side, each against a fresh ``import torch``.

    git worktree add /tmp/wd-old <commit> --detach
    python benchmarks/resolve_ab.py /tmp/wd-old/src src --rounds 20

Every round runs ``import torch``, then ``import whichdevice; whichdevice.resolve_device()`` from
each ``src`` folder, each in a fresh interpreter, the order reversed every other round
(``procs.measure_group``), so the three are neighbours in time on a shared machine. Prints each
checkout's time over ``import torch`` (median of the per-round ratios, p25..p75) and new over old.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from procs import clean_env, measure_group, python


def resolve_from(src: str) -> list[str]:
    return python(f"import sys; sys.path.insert(0, {src!r}); import whichdevice; whichdevice.resolve_device()")


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.3f}x (p25..p75 {q[0]:.3f}..{q[2]:.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("old", help="the old checkout's src folder")
    ap.add_argument("new", help="the new checkout's src folder")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    env, _ = clean_env()
    commands = {
        "import torch": python("import torch"),
        "old": resolve_from(os.path.abspath(args.old)),
        "new": resolve_from(os.path.abspath(args.new)),
    }
    group = measure_group(commands, args.rounds, env, "/", baseline="import torch", log=print)
    if group["errors"]:
        print("errors:", group["errors"])
        return 1
    secs = {name: entry["seconds"] for name, entry in group["commands"].items()}
    cpu = {name: entry["cpu_seconds"] for name, entry in group["commands"].items()}
    torch = secs["import torch"]
    print(f"import torch: median {statistics.median(torch):.3f} s over {args.rounds} rounds")
    for name in ("old", "new"):
        wall = [s / t for s, t in zip(secs[name], torch, strict=True)]
        cpus = [s / t for s, t in zip(cpu[name], cpu["import torch"], strict=True)]
        print(f"{name}: time {quartiles(wall)}, CPU time {quartiles(cpus)} of import torch")
    print(f"new / old, time: {quartiles([n / o for n, o in zip(secs['new'], secs['old'], strict=True)])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
