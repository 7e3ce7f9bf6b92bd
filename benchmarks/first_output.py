"""The first call's first output, on a terminal: when does a new user see something, and when is it done? (issue 46)

    python benchmarks/first_output.py --rounds 10
    python benchmarks/first_output.py --rounds 10 --busy 2     # two spinning processes beside it

Each round runs, in a fresh interpreter on a pseudo-terminal (stdout and stderr both, as a user's
shell gives them), the order reversed every other round:

- ``import torch``: the floor, time to exit;
- ``whichdevice`` with an empty calibration cache (``WHICHDEVICE_CALIBRATION`` a new folder): the first
  call a new user makes, calibration included;
- ``whichdevice`` with the cache that call left: every later call.

For each it records the time to the first byte written to the terminal (the progress line, the report)
and to exit. Prints medians and each as a ratio of the same round's ``import torch`` (median of the
per-round ratios, p25..p75). ``--busy N`` starts N processes spinning a core for the whole run: these
machines are shared, and a user's laptop is rarely idle.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pty
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def timed_on_terminal(argv: list[str], env: dict[str, str]) -> tuple[float, float, bytes]:
    """Run ``argv`` with a pseudo-terminal as stdout and stderr; (seconds to first byte, to exit, output)."""
    main_fd, child_fd = pty.openpty()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child_fd, stderr=child_fd, env=env)
    os.close(child_fd)
    first, out = float("nan"), b""
    while True:
        ready, _, _ = select.select([main_fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # the child closed its end
                chunk = b""
            if chunk and not out:
                first = time.perf_counter() - start
            out += chunk
            if not chunk and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.wait()
    done = time.perf_counter() - start
    os.close(main_fd)
    if proc.returncode:
        raise SystemExit(f"{argv} exited {proc.returncode}: {out[-2000:]!r}")
    return first, done, out


def spin() -> None:
    while True:
        pass


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.2f}x (p25..p75 {q[0]:.2f}..{q[2]:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning a core each during the run")
    args = ap.parse_args()
    command = shutil.which("whichdevice")
    wd = [command] if command else [sys.executable, "-m", "whichdevice"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHICHDEVICE_")}
    env.setdefault("TERM", "xterm")
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    names = ("import torch", "whichdevice, first call", "whichdevice, cached")
    first: dict[str, list[float]] = {n: [] for n in names}
    done: dict[str, list[float]] = {n: [] for n in names}
    try:
        timed_on_terminal([sys.executable, "-c", "import torch"], env)  # page cache warm, bytecode compiled
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="whichdevice-first-") as cache:
                runs = {
                    "import torch": ([sys.executable, "-c", "import torch"], env),
                    "whichdevice, first call": (wd, {**env, "WHICHDEVICE_CALIBRATION": cache}),
                }
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for name in order:
                    f, d, _ = timed_on_terminal(*runs[name])
                    first[name].append(f)
                    done[name].append(d)
                # the cache the first call left: every later call
                f, d, _ = timed_on_terminal(wd, {**env, "WHICHDEVICE_CALIBRATION": cache})
                first[names[2]].append(f)
                done[names[2]].append(d)
            print(
                f"round {r + 1}/{args.rounds}: "
                + ", ".join(f"{n} first {first[n][-1]:.2f} s, exit {done[n][-1]:.2f} s" for n in names),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for p in spinners:
            p.terminate()
    load = os.getloadavg()[0]
    print(f"{args.rounds} rounds, {args.busy} spinning beside it, load average {load:.2f}, {os.cpu_count()} CPUs")
    torch = done["import torch"]
    print(f"import torch: exit {statistics.median(torch):.2f} s (median)")
    for name in names[1:]:
        print(
            f"{name}: first output {statistics.median(first[name]):.2f} s = "
            f"{quartiles([f / t for f, t in zip(first[name], torch, strict=True)])} of import torch; "
            f"exit {statistics.median(done[name]):.2f} s = "
            f"{quartiles([d / t for d, t in zip(done[name], torch, strict=True)])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
