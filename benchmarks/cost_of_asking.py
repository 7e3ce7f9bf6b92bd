"""What does it cost to ask whichdevice, against import torch and the other libraries, and what does the answer buy?

    python benchmarks/cost_of_asking.py            # every section, ~14 min on 2 cores (also: nox -s bench)
    python benchmarks/cost_of_asking.py --quick    # fewer rounds and a smaller model: ~4 min
    python benchmarks/cost_of_asking.py --only resolve --only cli
    python benchmarks/cost_of_asking.py --ab /tmp/wd-old/src src --rounds 20   # two checkouts' resolve, same rounds

Sections (rows of the table):

1. ``import``: a fresh ``python -c "import whichdevice"`` minus ``python -c pass`` (alternated pairs),
   and which heavy modules it imports (none: torch, transformers and accelerate stay out);
2. ``resolve``: a fresh ``import whichdevice; resolve_device()`` (and ``resolve_device(model=folder)``)
   against a fresh ``import torch``: time, CPU time and peak RSS;
3. ``warm``: a repeated ``resolve_device()`` in one process, per call;
4. ``cli``: ``whichdevice --json`` against ``import torch``, ``accelerate env`` and ``transformers env``;
5. ``compare``: accelerate's ``PartialState().device``, ``TrainingArguments(...).device`` and
   ``torch.accelerator.current_accelerator()``, each against ``import torch``;
6. ``quality``: what the answer buys: ``cpu_dtype_and_tuning.py sweep`` run as a child (a 106M Llama's
   tokens/s loaded as resolved, by transformers' default and every dtype x attention);
7. ``terminal``: ``whichdevice`` on a pseudo-terminal, with an empty calibration cache (a new user's
   first call) and with the cache it left, against ``import torch``: time to the first byte and to exit.

Every command is a fresh process in a clean environment (harness.clean_env), alternated with its
baseline round by round (harness.alternate_commands); the table shows medians and the median of the
per-round ratios with the 25th..75th percentiles as the noise, and a PASS/FAIL per target.
Takes ``--json PATH`` (default benchmarks/results/cost_of_asking.json); a full run of every section
also writes ``benchmarks/latest.json`` (committed; the figures of docs/performance.md's first table).
``--strict`` exits 1 when a target fails: figures are read, not asserted by timed tests.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
from harness import alternate_commands, clean_env, last_error, log, python, run_once, summary

SECTIONS = ("import", "resolve", "warm", "cli", "compare", "terminal", "quality")
HEAVY = ("torch", "transformers", "accelerate")
REPS = {  # (full, quick)
    "import": (30, 8),  # alternated pairs
    "resolve": (20, 5),  # alternated pairs
    "warm": (15, 5),  # timed repeats of a calibrated loop
    "cli": (20, 3),  # rounds of 4 commands: 20 alternated pairs (issue 48); a shared machine varies 10-20%
    "compare": (7, 3),  # rounds of 4 commands
    "terminal": (10, 3),  # rounds of import torch, a first call and a cached call
    "quality": (4, 2),  # rounds over every configuration of the sweep
    "contenders": (8, 2),  # further rounds over the resolved configuration and those near the fastest
}
TARGETS = {"import_ms": 30.0, "resolve_time": 1.05, "resolve_rss": 1.10, "warm_us": 20.0, "cli_time": 1.10}
QUALITY_TARGET = 0.95


def console(name: str, *args: str) -> list[str] | None:
    """argv for a console script of this environment (next to sys.executable), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    return [found, *args] if found else None


def row(
    target: str,
    measure: str,
    baseline: str = "",
    measured: str = "",
    result: str = "",
    spread: str = "",
    threshold: str = "",
    verdict: str = "info",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "target": target,
        "measure": measure,
        "baseline": baseline,
        "measured": measured,
        "result": result,
        "spread": spread,
        "threshold": threshold,
        "verdict": verdict,
        **extra,
    }


def ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def secs(s: float) -> str:
    return f"{s:.3f} s" if s < 10 else f"{s:.2f} s"


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def spread(s: dict[str, float]) -> str:
    return f"{s['p25']:.3f}..{s['p75']:.3f}x"


def ratio_rows(
    target: str,
    group: dict[str, Any],
    baseline: str,
    name: str,
    measure: str,
    *,
    limit: float | None = None,
    rss_limit: float | None = None,
    base_label: str = "",
) -> list[dict[str, Any]]:
    """Rows for ``name`` against ``baseline`` in a measured group: time, CPU time and peak RSS."""
    cmds = group["commands"]
    if name in group["errors"] and "time_ratio" not in cmds[name]:
        return [row(target, measure, verdict="n/a", result="not available", spread=group["errors"][name])]
    b, c = cmds[baseline], cmds[name]
    tr, cr, mr = c["time_ratio"], c["cpu_ratio"], c["rss_ratio"]
    out = [
        row(
            target,
            f"{measure}: time",
            f"{base_label} {secs(b['time']['median'])}".strip(),
            secs(c["time"]["median"]),
            f"{tr['median']:.3f}x",
            spread(tr),
            f"<= {limit:.2f}x" if limit else "",
            verdict(tr["median"] <= limit) if limit else "info",
            value=tr["median"],
        ),
        row(
            target,
            f"{measure}: CPU time (user+sys)",
            f"{base_label} {secs(b['cpu']['median'])}".strip(),
            secs(c["cpu"]["median"]),
            f"{cr['median']:.3f}x",
            spread(cr),
            value=cr["median"],
        ),
        row(
            target,
            f"{measure}: peak RSS",
            f"{base_label} {mib(b['rss']['median'])}".strip(),
            mib(c["rss"]["median"]),
            f"{mr['median']:.3f}x",
            spread(mr),
            f"<= {rss_limit:.2f}x" if rss_limit else "",
            verdict(mr["median"] <= rss_limit) if rss_limit else "info",
            value=mr["median"],
        ),
    ]
    if name in group["errors"]:
        out[0]["verdict"] = "FAIL"
        out[0]["spread"] += f" (failed: {group['errors'][name]})"
    return out


class Context:
    def __init__(self, args: argparse.Namespace, env: dict[str, str], cwd: str) -> None:
        self.args, self.quick, self.env, self.cwd = args, args.quick, env, cwd
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}
        self.load: dict[str, Any] = {}
        self.cli_missing = False

    def reps(self, section: str) -> int:
        return self.args.reps or REPS[section][1 if self.quick else 0]

    def progress(self, msg: str) -> None:
        if not self.args.silent:
            log(msg)

    def group(self, commands: dict[str, list[str]], section: str, baseline: str) -> dict[str, Any]:
        return alternate_commands(
            commands, self.reps(section), self.env, self.cwd, baseline=baseline, progress=self.progress
        )


# ------------------------------------------------------------------------------------- 1. import

IMPORT_CHECK = """
import json, sys, time
t = time.perf_counter()
import whichdevice
t = time.perf_counter() - t
mods = sorted(sys.modules)
print(json.dumps({
    "in_process_s": t,
    "heavy": sorted({m.split('.')[0] for m in mods} & {HEAVY}),
    "whichdevice_modules": [m for m in mods if m.split('.')[0] == 'whichdevice'],
    "module_count": len(mods),
}))
""".replace("{HEAVY}", "{" + ", ".join(repr(h) for h in HEAVY) + "}")


def importtime_top(env: dict[str, str], cwd: str, n: int = 8) -> list[dict[str, Any]]:
    """Largest self times under ``import whichdevice`` (python -X importtime), for the JSON."""
    s = run_once([sys.executable, "-X", "importtime", "-c", "import whichdevice"], env, cwd, keep_output=True)
    entries = []
    for line in s.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) == 3:
            entries.append({"module": parts[2].strip(), "self_us": int(parts[0]), "cumulative_us": int(parts[1])})
    return sorted(entries, key=lambda e: -e["self_us"])[:n]


def section_import(ctx: Context) -> None:
    group = ctx.group(
        {"python -c pass": python("pass"), "import whichdevice": python("import whichdevice")},
        "import",
        "python -c pass",
    )
    check = run_once(python(IMPORT_CHECK), ctx.env, ctx.cwd, keep_output=True)
    info = json.loads(check.stdout) if check.returncode == 0 else {"error": last_error(check)}
    info["importtime_top_self"] = importtime_top(ctx.env, ctx.cwd)
    ctx.data["import"] = {"group": group, "check": info}
    if "import whichdevice" in group["errors"]:
        ctx.rows.append(row("1", "import whichdevice", verdict="FAIL", result=group["errors"]["import whichdevice"]))
        return
    base, wd = group["commands"]["python -c pass"], group["commands"]["import whichdevice"]
    for what, key, delta, extra in (
        ("", "time", "time_delta", True),
        (": CPU time (user+sys)", "cpu", "cpu_delta", False),
    ):
        added = (wd[key]["median"] - base[key]["median"]) * 1000
        d = wd[delta]
        ctx.rows.append(
            row(
                "1",
                f"import whichdevice - python -c pass{what}",
                f"pass {ms(base[key]['median'])}",
                ms(wd[key]["median"]),
                f"+{added:.1f} ms",
                f"pairwise +{d['p25'] * 1000:.1f}..{d['p75'] * 1000:.1f} ms",
                f"< {TARGETS['import_ms']:.0f} ms" if extra else "",
                verdict(added < TARGETS["import_ms"]) if extra else "info",
                value=added,
            )
        )
    heavy = info.get("heavy")
    ctx.rows.append(
        row(
            "1",
            "import whichdevice imports torch/transformers/accelerate",
            measured=", ".join(heavy) if heavy else ("none" if heavy is not None else info.get("error", "?")),
            result=f"{len(info.get('whichdevice_modules', []))} whichdevice modules",
            threshold="none",
            verdict=verdict(heavy == []),
        )
    )


# ------------------------------------------------------------------------------------- 2. resolve


def tiny_model_folder(folder: str) -> str:
    """A small bf16 Llama (config.json + safetensors) for ``resolve_device(model=)``: the real reading path."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); import harness\n"
        "harness.save_model(sys.argv[1], 'bfloat16', hidden_size=256, intermediate_size=512, num_hidden_layers=4,"
        " num_attention_heads=4, num_key_value_heads=2, vocab_size=2000, max_position_embeddings=512)\n"
    )
    subprocess.run([sys.executable, "-c", code, folder, str(harness.HERE)], check=True, capture_output=True)
    return folder


def section_resolve(ctx: Context) -> None:
    folder = tiny_model_folder(os.path.join(ctx.cwd, "tiny-llama"))
    torch_only = python("import torch")
    # The target's pairs run alone: a process that follows a heavier one (model= imports transformers,
    # 3x import torch) runs slower, and in a round of all three the reversed rounds put the bare resolve
    # after it while import torch never was (measured, 20 rounds: 1.051x in the forward rounds, 1.163x
    # in the reversed ones, 1.068x over all; results-56/resolve_order.md).
    group = ctx.group(
        {"import torch": torch_only, "resolve": python("import whichdevice; whichdevice.resolve_device()")},
        "resolve",
        "import torch",
    )
    with_model = python(f"import whichdevice; whichdevice.resolve_device(model={folder!r})")
    model_group = ctx.group({"import torch": torch_only, "resolve model=": with_model}, "resolve", "import torch")
    ctx.data["resolve"] = {"group": group, "model_group": model_group}
    ctx.rows += ratio_rows(
        "2",
        group,
        "import torch",
        "resolve",
        "import whichdevice; resolve_device() / import torch",
        limit=TARGETS["resolve_time"],
        rss_limit=TARGETS["resolve_rss"],
        base_label="torch",
    )
    # model= reads config.json and the safetensors headers, and checks the architecture's classes in
    # the installed transformers (which imports it): quoted beside the bare call, no target of its own.
    measure = "import whichdevice; resolve_device(model=tiny folder) / import torch"
    ctx.rows += ratio_rows("2", model_group, "import torch", "resolve model=", measure, base_label="torch")


def ab(args: argparse.Namespace) -> int:
    """Two checkouts' fresh ``resolve_device()``, each against a fresh ``import torch``, in the same rounds."""
    old, new = (os.path.abspath(p) for p in args.ab)

    def resolve_from(src: str) -> list[str]:
        return python(f"import sys; sys.path.insert(0, {src!r}); import whichdevice; whichdevice.resolve_device()")

    env, _ = clean_env()
    commands = {"import torch": python("import torch"), "old": resolve_from(old), "new": resolve_from(new)}
    group = alternate_commands(commands, args.rounds or 20, env, "/", baseline="import torch", progress=print)
    if group["errors"]:
        print("errors:", group["errors"])
        return 1
    cmds = group["commands"]
    print(f"import torch: median {cmds['import torch']['time']['median']:.3f} s over {group['rounds']} rounds")
    for name in ("old", "new"):
        print(
            f"{name}: time {harness.ratio_text(cmds[name]['time_ratio'])}, "
            f"CPU time {harness.ratio_text(cmds[name]['cpu_ratio'])} of import torch"
        )
    print(f"new / old, time: {harness.ratio_text(harness.pairwise(cmds['new']['seconds'], cmds['old']['seconds']))}")
    harness.write_json(args.json, {"machine": harness.machine(env), "ab": {"old": old, "new": new}, "group": group})
    return 0


# ------------------------------------------------------------------------------------- 3. warm

WARM = """
import json, time
import whichdevice
t = time.perf_counter()
first = whichdevice.resolve_device()
first_s = time.perf_counter() - t
resolve = whichdevice.resolve_device
n = 1
while True:
    t = time.perf_counter()
    for _ in range(n):
        resolve()
    el = time.perf_counter() - t
    if el >= 0.05:
        break
    n *= 2
n = max(1, int(n * 0.2 / el))
per = []
for _ in range(REPEATS):
    t = time.perf_counter()
    for _ in range(n):
        resolve()
    per.append((time.perf_counter() - t) / n)
print(json.dumps({"first_call_s": first_s, "calls_per_repeat": n, "per_call_s": per, "device": str(first),
                  "dtype": first.dtype_name, "attn": first.attn_implementation}))
"""


def section_warm(ctx: Context) -> None:
    s = run_once(python(WARM.replace("REPEATS", str(ctx.reps("warm")))), ctx.env, ctx.cwd, keep_output=True)
    if s.returncode != 0:
        ctx.data["warm"] = {"error": last_error(s)}
        ctx.rows.append(row("3", "warm resolve_device() per call", verdict="FAIL", result=last_error(s)))
        return
    info = json.loads(s.stdout)
    info["per_call"] = st = summary(info["per_call_s"])
    ctx.data["warm"] = info
    ctx.progress(f"  {st['median'] * 1e6:.1f} us per call ({info['calls_per_repeat']} calls per repeat)")
    ctx.rows.append(
        row(
            "3",
            "warm resolve_device(), repeated call",
            f"first call {ms(info['first_call_s'])}",
            f"{st['median'] * 1e6:.1f} us",
            f"{st['median'] * 1e6:.1f} us",
            f"{st['p25'] * 1e6:.1f}..{st['p75'] * 1e6:.1f} us",
            f"< {TARGETS['warm_us']:.0f} us",
            verdict(st["median"] * 1e6 < TARGETS["warm_us"]),
            value=st["median"] * 1e6,
        )
    )


# ------------------------------------------------------------------------------------- 4. cli


def cli_available(ctx: Context) -> tuple[list[str] | None, str | None]:
    argv = console("whichdevice", "--json") or [sys.executable, "-m", "whichdevice", "--json"]
    s = run_once(argv, ctx.env, ctx.cwd, keep_output=True)
    if s.returncode != 0:
        return None, f"`whichdevice --json` exited {s.returncode}: {last_error(s)}"
    try:
        json.loads(s.stdout)
    except ValueError as exc:
        return None, f"`whichdevice --json` printed no JSON ({exc})"
    return argv, None


def section_cli(ctx: Context) -> None:
    argv, why = cli_available(ctx)
    commands: dict[str, list[str]] = {"import torch": python("import torch")}
    if argv is not None:
        commands["whichdevice --json"] = argv
    for tool in ("accelerate", "transformers"):
        found = console(tool, "env")
        if found is not None:
            commands[f"{tool} env"] = found
    group = ctx.group(commands, "cli", "import torch")
    ctx.data["cli"] = {"group": group, "available": argv is not None, "unavailable_reason": why}
    ctx.cli_missing = argv is None
    if argv is None:
        ctx.rows.append(
            row("4", "whichdevice --json / import torch", verdict="n/a", result="not available", spread=why)
        )
    else:
        measure = "whichdevice --json / import torch"
        ctx.rows += ratio_rows(
            "4", group, "import torch", "whichdevice --json", measure, limit=TARGETS["cli_time"], base_label="torch"
        )
    cmds = group["commands"]
    for tool in ("accelerate env", "transformers env"):
        if tool in cmds:
            ctx.rows += ratio_rows("4", group, "import torch", tool, f"{tool} / import torch", base_label="torch")[:1]
    for tool in ("accelerate env", "transformers env"):
        if argv is not None and "seconds" in cmds.get(tool, {}):
            over = harness.pairwise(cmds["whichdevice --json"]["seconds"], cmds[tool]["seconds"])
            cmds[tool][f"whichdevice_over_{tool.split()[0]}"] = over
            ctx.rows.append(
                row(
                    "4",
                    f"whichdevice --json / {tool}",
                    f"{tool.split()[0]} {secs(cmds[tool]['time']['median'])}",
                    secs(cmds["whichdevice --json"]["time"]["median"]),
                    f"{over['median']:.3f}x",
                    spread(over),
                )
            )


# ------------------------------------------------------------------------------------- 5. compare

COMPARE = {
    "accelerate PartialState().device": "import accelerate; accelerate.PartialState().device",
    "TrainingArguments(output_dir).device": (
        "import tempfile\nfrom transformers import TrainingArguments\n"
        "TrainingArguments(output_dir=tempfile.mkdtemp()).device"
    ),
    "torch.accelerator.current_accelerator()": "import torch; torch.accelerator.current_accelerator()",
}


def section_compare(ctx: Context) -> None:
    commands = {"import torch": python("import torch")} | {k: python(v) for k, v in COMPARE.items()}
    group = ctx.group(commands, "compare", "import torch")
    ctx.data["compare"] = {"group": group}
    for name in COMPARE:
        ctx.rows += ratio_rows("5", group, "import torch", name, f"{name} / import torch", base_label="torch")


# ------------------------------------------------------------------------------------- 6. quality


def section_quality(ctx: Context) -> None:
    out = Path(ctx.cwd) / "sweep.json"
    argv = [sys.executable, str(harness.HERE / "cpu_dtype_and_tuning.py"), "sweep", "--json", str(out)]
    argv += ["--rounds", str(ctx.reps("quality")), "--contender-rounds", str(ctx.reps("contenders"))]
    argv += ["--quick"] * ctx.quick + (["--threads", str(ctx.args.threads)] if ctx.args.threads else [])
    start = time.perf_counter()
    # The sweep's own table goes to stderr with its progress: this script prints it with its rows.
    proc = subprocess.run(argv, env=ctx.env, cwd=ctx.cwd, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    if proc.returncode != 0 or not out.exists():
        ctx.data["quality"] = {"error": f"cpu_dtype_and_tuning.py sweep exited {proc.returncode}"}
        ctx.rows.append(row("6", "choice quality", verdict="FAIL", result=ctx.data["quality"]["error"]))
        return
    info = json.loads(out.read_text())["sweep"]
    info["wall_s"] = time.perf_counter() - start
    ctx.data["quality"] = info
    from harness import short

    for ckpt, c in info["checkpoints"].items():
        cfg = c["configs"]
        res, dflt, best = cfg["resolved"], cfg["default"], cfg[c["best"]]
        vb, vd = c["resolved_vs_best"], c["resolved_vs_default"]
        ctx.rows.append(
            row(
                "6",
                f"{short(ckpt)} checkpoint: resolved ({res['config']}) / best of sweep ({c['best']})",
                f"{best['summary']['median']:.1f} tok/s",
                f"{res['summary']['median']:.1f} tok/s",
                f"{vb['median_pairwise']:.3f}x",
                spread(vb["summary"]),
                f">= {QUALITY_TARGET:.2f}x",
                verdict(vb["median_pairwise"] >= QUALITY_TARGET),
                value=vb["median_pairwise"],
            )
        )
        ctx.rows.append(
            row(
                "6",
                f"{short(ckpt)} checkpoint: resolved / transformers default ({dflt['config']})",
                f"{dflt['summary']['median']:.1f} tok/s",
                f"{res['summary']['median']:.1f} tok/s",
                f"{vd['median_pairwise']:.3f}x",
                spread(vd["summary"]),
                value=vd["median_pairwise"],
            )
        )


# ------------------------------------------------------------------------------------- 7. terminal


def timed_on_terminal(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``argv`` with a pseudo-terminal as stdout and stderr: (seconds to its first byte, to exit)."""
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
    return first, done


def section_terminal(ctx: Context) -> None:
    """A new user's first ``whichdevice`` (calibration included) and every later one, on a terminal."""
    wd = console("whichdevice") or [sys.executable, "-m", "whichdevice"]
    env = {**ctx.env, "TERM": ctx.env.get("TERM", "xterm")}
    torch_argv = python("import torch")
    names = ("import torch", "whichdevice, first call", "whichdevice, cached")
    first: dict[str, list[float]] = {n: [] for n in names}
    done: dict[str, list[float]] = {n: [] for n in names}
    timed_on_terminal(torch_argv, env)  # page cache warm, bytecode compiled
    for r in range(ctx.reps("terminal")):
        with tempfile.TemporaryDirectory(prefix="whichdevice-first-") as cache:
            runs = {names[0]: (torch_argv, env), names[1]: (wd, {**env, "WHICHDEVICE_CALIBRATION": cache})}
            for name in harness.round_order(list(runs), r):
                f, d = timed_on_terminal(*runs[name])
                first[name].append(f)
                done[name].append(d)
            f, d = timed_on_terminal(wd, {**env, "WHICHDEVICE_CALIBRATION": cache})  # the cache it left
            first[names[2]].append(f)
            done[names[2]].append(d)
        ctx.progress(f"  round {r + 1}: " + ", ".join(f"{n} {first[n][-1]:.2f}/{done[n][-1]:.2f} s" for n in names))
    ctx.data["terminal"] = {"first_byte_s": first, "exit_s": done}
    torch_s = done["import torch"]
    for name in names[1:]:
        for what, values in (("first output", first[name]), ("exit", done[name])):
            over = harness.pairwise(values, torch_s)
            ctx.rows.append(
                row(
                    "7",
                    f"{name} on a terminal: {what} / import torch",
                    f"torch {secs(summary(torch_s)['median'])}",
                    secs(summary(values)["median"]),
                    f"{over['median']:.2f}x",
                    spread(over),
                    value=over["median"],
                )
            )


RUNNERS: dict[str, Callable[[Context], None]] = {
    "import": section_import,
    "resolve": section_resolve,
    "warm": section_warm,
    "cli": section_cli,
    "compare": section_compare,
    "terminal": section_terminal,
    "quality": section_quality,
}


def run_section(ctx: Context, name: str) -> None:
    log(f"[{name}] {time.strftime('%H:%M:%S')}, load average {harness.load_average():.2f}")
    before, start = harness.load_average(), time.perf_counter()
    RUNNERS[name](ctx)
    ctx.load[name] = {"loadavg_1m_before": before, "loadavg_1m_after": harness.load_average()}
    ctx.load[name]["seconds"] = time.perf_counter() - start


COLUMNS = ("#", "measure", "baseline", "measured", "result", "noise (p25..p75)", "target", "verdict")
KEYS = ("target", "measure", "baseline", "measured", "result", "spread", "threshold", "verdict")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller model")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    ap.add_argument("--reps", type=int, default=None, help="override every section's repetition count")
    ap.add_argument("--rounds", type=int, default=None, help="--ab's rounds (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the quality section")
    ap.add_argument("--silent", action="store_true", help="no per-round progress on stderr")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning a core each during the run")
    ap.add_argument("--ab", nargs=2, metavar=("OLD_SRC", "NEW_SRC"), help="two checkouts' src folders, side by side")
    harness.add_json_argument(ap, default=str(harness.RESULTS / "cost_of_asking.json"))
    ap.add_argument("--no-json", action="store_true", help="print only; write no JSON")
    args = ap.parse_args()
    if args.no_json:
        args.json = None
    if args.ab:
        return ab(args)
    sections = [s for s in SECTIONS if not args.only or s in args.only]
    env, dropped = clean_env()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="whichdevice-bench-cwd-") as cwd, harness.spinning(args.busy):
        ctx = Context(args, env, cwd)
        machine = harness.machine(env)
        log(harness.machine_line(machine))
        for name in sections:
            run_section(ctx, name)
        retried = False
        if "cli" in sections and ctx.cli_missing:
            log("[cli] `whichdevice --json` was not available: trying once more at the end")
            ctx.rows = [r for r in ctx.rows if r["target"] != "4"]
            run_section(ctx, "cli")
            retried = True
    duration = time.perf_counter() - t0
    ctx.rows.sort(key=lambda r: r["target"])
    mode = "quick" if args.quick else "full"
    header = f"whichdevice cost of asking, {mode} run of {', '.join(sections)}; {machine['started']}"
    header += f", {args.busy} processes spinning beside it" if args.busy else ""
    header += f", {duration / 60:.1f} min"
    loads = ", ".join(f"{k} {v['loadavg_1m_before']:.1f}->{v['loadavg_1m_after']:.1f}" for k, v in ctx.load.items())
    failed = [f"{r['target']}: {r['measure']}" for r in ctx.rows if r["verdict"] in ("FAIL", "n/a")]
    rows = [[str(r[k]) for k in KEYS] for r in ctx.rows]
    text = [header, harness.machine_line(machine), f"load average (1 min) per section: {loads}", ""]
    text.append(harness.table(COLUMNS, rows) if rows else "(no rows)")
    if "checkpoints" in ctx.data.get("quality", {}):
        from cpu_dtype_and_tuning import sweep_table

        text += ["", sweep_table(ctx.data["quality"])]
    text += ["", "failing targets: " + ("; ".join(failed) if failed else "none")]
    print("\n".join(text), flush=True)
    doc = {
        "schema": 2,
        "script": "benchmarks/cost_of_asking.py",
        "started": machine["started"],
        "duration_s": duration,
        "mode": mode,
        "sections": sections,
        "machine": machine,
        "child_env": {"dropped": dropped, "set": {k: env[k] for k in sorted(set(env) - set(os.environ))}},
        "targets": {**TARGETS, "quality": QUALITY_TARGET},
        "repetitions": {s: ctx.reps(s) for s in REPS if s in sections or (s == "contenders" and "quality" in sections)},
        "load": ctx.load,
        "cli_retried": retried,
        "spinning": args.busy,
        "rows": ctx.rows,
        "failed": failed,
        "data": ctx.data,
        "table": "\n".join(text),
    }
    harness.write_json(args.json, doc)
    if args.json is not None and not args.quick and not args.only and not args.reps:
        harness.write_json(harness.HERE / "latest.json", doc)
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
