"""The whichdevice benchmark: what it costs to ask, and how fast the answer makes a model.

    python benchmarks/run.py              # everything (about 10-15 minutes on 2 cores)
    python benchmarks/run.py --quick      # fewer repetitions and a smaller model: a fast check
    python benchmarks/run.py --only warm --only cli

Sections: import (cost of ``import whichdevice``), resolve (a fresh process resolving, against a
fresh ``import torch``), warm (a repeated ``resolve_device()`` call), cli (``whichdevice --json``
beside ``accelerate env`` and ``transformers env``), compare (what other libraries take to answer the
same question), quality (tokens/s of a small Llama loaded the way whichdevice says, by default, and
every dtype x attention). Commands of a section alternate (forward, then reversed order) and the
table shows medians and the median of the pairwise ratios, with the quartiles as the noise.

Prints the table and writes the same as JSON to ``benchmarks/results/<timestamp>.json`` (and
``benchmarks/results/latest.json``); a full run of every section also writes ``benchmarks/latest.json``.
See benchmarks/README.md for what each row measures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import clean_env, last_error, measure_group, python, run_once, summary

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SECTIONS = ("import", "resolve", "warm", "cli", "compare", "quality")
HEAVY = ("torch", "transformers", "accelerate")

# repetitions: (full, quick)
REPS = {
    "import": (30, 8),  # alternated pairs
    "resolve": (20, 5),  # alternated pairs
    "warm": (15, 5),  # timed repeats of a calibrated loop
    "cli": (20, 3),  # rounds of 4 commands: 20 alternated pairs (issue 48); a shared machine varies 10-20%
    "compare": (7, 3),  # rounds of 4 commands
    "quality": (4, 2),  # rounds over every configuration of the sweep
    "contenders": (8, 2),  # further rounds over the resolved configuration and those near the fastest
}

TARGETS = {
    "import_ms": 30.0,
    "resolve_time": 1.05,
    "resolve_rss": 1.10,
    "warm_us": 20.0,
    "cli_time": 1.10,
    "quality": 0.95,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- machine


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "bf16", "fphp")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    memory = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "model": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "flags": {f: f in flags for f in wanted},
        "memory_gib": round(memory / 2**30, 1) if memory else None,
    }


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "--short", "HEAD"), "src_dirty": bool(status) if status is not None else None}


def machine_info(env: dict[str, str], cwd: str) -> dict[str, Any]:
    threads = run_once(python("import torch; print(torch.get_num_threads())"), env, cwd, keep_output=True)
    return {
        "cpu": cpu_info(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": {d: version(d) for d in ("torch", "transformers", "accelerate", "whichdevice")},
        "torch_threads": int(threads.stdout.strip()) if threads.returncode == 0 else None,
        "torch_thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "git": git_state(),
    }


def machine_line(m: dict[str, Any]) -> str:
    cpu = m["cpu"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items() if f != "fphp" and f != "bf16")
    v = m["versions"]
    return (
        f"machine: {cpu['model']}, {cpu['usable_cores']} of {cpu['cores']} cores, {cpu['memory_gib']} GiB; {flags}\n"
        f"         {m['platform']}; Python {m['python']}, torch {v['torch']} ({m['torch_threads']} threads), "
        f"transformers {v['transformers']}, accelerate {v['accelerate']}, whichdevice {v['whichdevice']} "
        f"(git {m['git']['commit']}{', src modified' if m['git']['src_dirty'] else ''})"
    )


# ------------------------------------------------------------------------------------- rows


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
    """Rows for ``name`` against ``baseline`` in a measured group: time, and peak RSS."""
    cmds = group["commands"]
    if name in group["errors"] and "time_ratio" not in cmds[name]:
        return [row(target, measure, verdict="n/a", result="not available", spread=group["errors"][name])]
    b, c = cmds[baseline], cmds[name]
    tr, mr = c["time_ratio"], c["rss_ratio"]
    out = [
        row(
            target,
            f"{measure}: time",
            f"{base_label} {secs(b['time']['median'])}".strip(),
            secs(c["time"]["median"]),
            f"{tr['median']:.3f}x",
            f"{tr['p25']:.3f}..{tr['p75']:.3f}x",
            f"<= {limit:.2f}x" if limit else "",
            verdict(tr["median"] <= limit) if limit else "info",
            value=tr["median"],
        )
    ]
    cr = c["cpu_ratio"]
    out.append(
        row(
            target,
            f"{measure}: CPU time (user+sys)",
            f"{base_label} {secs(b['cpu']['median'])}".strip(),
            secs(c["cpu"]["median"]),
            f"{cr['median']:.3f}x",
            f"{cr['p25']:.3f}..{cr['p75']:.3f}x",
            value=cr["median"],
        )
    )
    out.append(
        row(
            target,
            f"{measure}: peak RSS",
            f"{base_label} {mib(b['rss']['median'])}".strip(),
            mib(c["rss"]["median"]),
            f"{mr['median']:.3f}x",
            f"{mr['p25']:.3f}..{mr['p75']:.3f}x",
            f"<= {rss_limit:.2f}x" if rss_limit else "",
            verdict(mr["median"] <= rss_limit) if rss_limit else "info",
            value=mr["median"],
        )
    )
    if name in group["errors"]:
        out[0]["verdict"] = "FAIL"
        out[0]["spread"] += f" (failed: {group['errors'][name]})"
    return out


# ------------------------------------------------------------------------------------- sections

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
    n = ctx.reps("import")
    group = measure_group(
        {"python -c pass": python("pass"), "import whichdevice": python("import whichdevice")},
        n,
        ctx.env,
        ctx.cwd,
        baseline="python -c pass",
        log=ctx.progress,
    )
    check = run_once(python(IMPORT_CHECK), ctx.env, ctx.cwd, keep_output=True)
    info = json.loads(check.stdout) if check.returncode == 0 else {"error": last_error(check)}
    info["importtime_top_self"] = importtime_top(ctx.env, ctx.cwd)
    ctx.data["import"] = {"group": group, "check": info}
    cmds = group["commands"]
    if "import whichdevice" in group["errors"]:
        ctx.rows.append(row("1", "import whichdevice", verdict="FAIL", result=group["errors"]["import whichdevice"]))
        return
    base, wd = cmds["python -c pass"]["time"], cmds["import whichdevice"]["time"]
    delta = wd["median"] - base["median"]
    d = cmds["import whichdevice"]["time_delta"]
    ctx.rows.append(
        row(
            "1",
            "import whichdevice - python -c pass",
            f"pass {ms(base['median'])}",
            ms(wd["median"]),
            f"+{delta * 1000:.1f} ms",
            f"pairwise +{d['p25'] * 1000:.1f}..{d['p75'] * 1000:.1f} ms",
            f"< {TARGETS['import_ms']:.0f} ms",
            verdict(delta * 1000 < TARGETS["import_ms"]),
            value=delta * 1000,
        )
    )
    cpu_b, cpu_w, cd = (
        cmds["python -c pass"]["cpu"],
        cmds["import whichdevice"]["cpu"],
        cmds["import whichdevice"]["cpu_delta"],
    )
    ctx.rows.append(
        row(
            "1",
            "import whichdevice - python -c pass: CPU time (user+sys)",
            f"pass {ms(cpu_b['median'])}",
            ms(cpu_w["median"]),
            f"+{(cpu_w['median'] - cpu_b['median']) * 1000:.1f} ms",
            f"pairwise +{cd['p25'] * 1000:.1f}..{cd['p75'] * 1000:.1f} ms",
            value=(cpu_w["median"] - cpu_b["median"]) * 1000,
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


def _tiny_model_folder(folder: str) -> str:
    """A small Llama (config.json + safetensors) saved for the resolve(model=) row: the real reading path."""
    code = (
        "import sys, torch\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,"
        " num_key_value_heads=2, vocab_size=2000, max_position_embeddings=512)\n"
        "LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, folder], check=True, capture_output=True)
    return folder


def section_resolve(ctx: Context) -> None:
    folder = _tiny_model_folder(os.path.join(ctx.cwd, "tiny-llama"))
    group = measure_group(
        {
            "import torch": python("import torch"),
            "resolve": python("import whichdevice; whichdevice.resolve_device()"),
            "resolve model=": python(f"import whichdevice; whichdevice.resolve_device(model={folder!r})"),
        },
        ctx.reps("resolve"),
        ctx.env,
        ctx.cwd,
        baseline="import torch",
        log=ctx.progress,
    )
    ctx.data["resolve"] = {"group": group}
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
    ctx.rows += ratio_rows(
        "2",
        group,
        "import torch",
        "resolve model=",
        "import whichdevice; resolve_device(model=tiny folder) / import torch",
        base_label="torch",
    )


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


def console(name: str, *args: str) -> list[str] | None:
    """argv for a console script of this environment (next to sys.executable), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    return [found, *args] if found else None


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
        a = console(tool, "env")
        if a is not None:
            commands[f"{tool} env"] = a
    group = measure_group(commands, ctx.reps("cli"), ctx.env, ctx.cwd, baseline="import torch", log=ctx.progress)
    ctx.data["cli"] = {"group": group, "available": argv is not None, "unavailable_reason": why}
    if argv is None:
        ctx.rows.append(
            row("4", "whichdevice --json / import torch", verdict="n/a", result="not available", spread=why)
        )
        ctx.cli_missing = True
    else:
        ctx.cli_missing = False
        ctx.rows += ratio_rows(
            "4",
            group,
            "import torch",
            "whichdevice --json",
            "whichdevice --json / import torch",
            limit=TARGETS["cli_time"],
            base_label="torch",
        )
    for tool in ("accelerate env", "transformers env"):
        if tool in group["commands"]:
            ctx.rows += ratio_rows("4", group, "import torch", tool, f"{tool} / import torch", base_label="torch")[:1]
    if argv is not None:
        for tool in ("accelerate env", "transformers env"):
            if tool in group["commands"] and "seconds" in group["commands"][tool]:
                wd = group["commands"]["whichdevice --json"]["seconds"]
                other = group["commands"][tool]["seconds"]
                pr = summary([a / b for a, b in zip(wd, other, strict=True)])
                group["commands"][tool][f"whichdevice_over_{tool.split()[0]}"] = pr
                ctx.rows.append(
                    row(
                        "4",
                        f"whichdevice --json / {tool}",
                        f"{tool.split()[0]} {secs(group['commands'][tool]['time']['median'])}",
                        secs(group["commands"]["whichdevice --json"]["time"]["median"]),
                        f"{pr['median']:.3f}x",
                        f"{pr['p25']:.3f}..{pr['p75']:.3f}x",
                    )
                )


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
    group = measure_group(commands, ctx.reps("compare"), ctx.env, ctx.cwd, baseline="import torch", log=ctx.progress)
    ctx.data["compare"] = {"group": group}
    for name in COMPARE:
        ctx.rows += ratio_rows("5", group, "import torch", name, f"{name} / import torch", base_label="torch")


def section_quality(ctx: Context) -> None:
    out = Path(ctx.cwd) / "generation.json"
    argv = [sys.executable, str(HERE / "generation.py"), "--out", str(out), "--rounds", str(ctx.reps("quality"))]
    argv += ["--contender-rounds", str(ctx.reps("contenders"))]
    if ctx.quick:
        argv.append("--quick")
    if ctx.args.threads:
        argv += ["--threads", str(ctx.args.threads)]
    start = time.perf_counter()
    proc = subprocess.run(argv, env=ctx.env, cwd=ctx.cwd, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    if proc.returncode != 0 or not out.exists():
        ctx.data["quality"] = {"error": f"generation.py exited {proc.returncode}"}
        ctx.rows.append(row("6", "choice quality", verdict="FAIL", result=f"generation.py exited {proc.returncode}"))
        return
    info = json.loads(out.read_text())
    info["wall_s"] = time.perf_counter() - start
    ctx.data["quality"] = info
    from whichdevice.core.dtypes import NAMES, short_name

    short = {name: short_name(name) for name in NAMES}
    for ckpt, c in info["checkpoints"].items():
        cfg = c["configs"]
        res, dflt, best = cfg["resolved"], cfg["default"], cfg[c["best"]]
        vb, vd = c["resolved_vs_best"], c["resolved_vs_default"]
        ctx.rows.append(
            row(
                "6",
                f"{short[ckpt]} checkpoint: resolved ({res['config']}) / best of sweep ({c['best']})",
                f"{best['summary']['median']:.1f} tok/s",
                f"{res['summary']['median']:.1f} tok/s",
                f"{vb['median_pairwise']:.3f}x",
                f"{vb['summary']['p25']:.3f}..{vb['summary']['p75']:.3f}x",
                f">= {TARGETS['quality']:.2f}x",
                verdict(vb["median_pairwise"] >= TARGETS["quality"]),
                value=vb["median_pairwise"],
            )
        )
        ctx.rows.append(
            row(
                "6",
                f"{short[ckpt]} checkpoint: resolved / transformers default ({dflt['config']})",
                f"{dflt['summary']['median']:.1f} tok/s",
                f"{res['summary']['median']:.1f} tok/s",
                f"{vd['median_pairwise']:.3f}x",
                f"{vd['summary']['p25']:.3f}..{vd['summary']['p75']:.3f}x",
                value=vd["median_pairwise"],
            )
        )


class Context:
    def __init__(self, args: argparse.Namespace, env: dict[str, str], cwd: str) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.env = env
        self.cwd = cwd
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}
        self.load: dict[str, Any] = {}
        self.cli_missing = False

    def reps(self, section: str) -> int:
        override = self.args.reps
        return override if override else REPS[section][1 if self.quick else 0]

    def progress(self, msg: str) -> None:
        if not self.args.silent:
            log(msg)


RUNNERS: dict[str, Callable[[Context], None]] = {
    "import": section_import,
    "resolve": section_resolve,
    "warm": section_warm,
    "cli": section_cli,
    "compare": section_compare,
    "quality": section_quality,
}


def run_section(ctx: Context, name: str) -> None:
    log(f"[{name}] {time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.2f}")
    before, start = os.getloadavg()[0], time.perf_counter()
    RUNNERS[name](ctx)
    ctx.load[name] = {"loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]}
    ctx.load[name]["seconds"] = time.perf_counter() - start


# ------------------------------------------------------------------------------------- output

COLUMNS = (
    ("#", "target"),
    ("measure", "measure"),
    ("baseline", "baseline"),
    ("measured", "measured"),
    ("result", "result"),
    ("noise (p25..p75)", "spread"),
    ("target", "threshold"),
    ("verdict", "verdict"),
)


def table(rows: list[dict[str, Any]]) -> str:
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) for h, k in COLUMNS]
    widths[5] = min(widths[5], 40)

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.ljust(w) if i < 7 else c for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line([h for h, _ in COLUMNS]), "-+-".join("-" * w for w in widths)]
    for r in rows:
        out.append(line([str(r[k]) for _, k in COLUMNS]))
    return "\n".join(out)


def sweep_table(q: dict[str, Any]) -> str:
    ckpts = list(q["checkpoints"])
    from whichdevice.core.dtypes import NAMES, short_name

    short = {name: short_name(name) for name in NAMES}
    labels = list(q["checkpoints"][ckpts[0]]["configs"])
    head = ["tokens/s (median, p25..p75)"] + [f"{short[c]} checkpoint" for c in ckpts]
    body = []
    for lab in labels:
        cells = [lab]
        for c in ckpts:
            e = q["checkpoints"][c]["configs"][lab]
            s = e["summary"]
            name = f" = {e['config']}" if lab in ("resolved", "default") else ""
            star = " *" if q["checkpoints"][c]["best"] == lab else ""
            cells.append(f"{s['median']:.1f} ({s['p25']:.1f}..{s['p75']:.1f}){name}{star}")
        body.append(cells)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    for c in ckpts:
        k = q["checkpoints"][c]
        kinds = k["round_kinds"]
        n_all = kinds.count("all")
        lines.append(
            f"{short[c]} checkpoint: {n_all} rounds over all 8, then {len(kinds) - n_all} over "
            f"{', '.join(k['contenders'])}; disturbed rounds (left out where 2 clean remain): "
            f"{k['rounds_disturbed'] or 'none'}"
        )
        v = k.get("resolved_vs_same_config")
        if v:
            spread = f"{v['summary']['p25']:.3f}..{v['summary']['p75']:.3f}"
            lines.append(
                f"{short[c]} checkpoint: resolved / {q['checkpoints'][c]['same_config']} of the sweep (same settings, "
                f"so 1.00 but for noise): {v['median_pairwise']:.3f}x ({spread})"
            )
    m = q["model"]
    w = q["workload"]
    lines.append(
        f"model: Llama {m['parameters'] / 1e6:.0f}M (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, intermediate {m['intermediate_size']}, vocab {m['vocab_size']}); "
        f"batch {w['batch']} x {w['prompt_tokens']} prompt tokens, {w['new_tokens']} new tokens greedy; "
        f"a warm-up round, then timed rounds, each model loaded afresh per round; "
        f"torch threads {q['torch_threads']}; * = best of the sweep"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller model")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    ap.add_argument("--reps", type=int, default=None, help="override every section's repetition count")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the quality section")
    ap.add_argument("--silent", action="store_true", help="no per-round progress on stderr")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    ap.add_argument("--no-json", action="store_true", help="print only; write no JSON")
    args = ap.parse_args()
    sections = [s for s in SECTIONS if not args.only or s in args.only]

    env, dropped = clean_env()
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="whichdevice-bench-cwd-") as cwd:
        ctx = Context(args, env, cwd)
        machine = machine_info(env, cwd)
        log(machine_line(machine))
        for name in sections:
            run_section(ctx, name)
        retried = False
        if "cli" in sections and ctx.cli_missing:
            log("[cli] `whichdevice --json` was not available: trying once more at the end")
            ctx.rows = [r for r in ctx.rows if r["target"] != "4"]
            run_section(ctx, "cli")
            retried = True
    duration = time.perf_counter() - t0
    order = {s: i for i, s in enumerate("123456")}
    ctx.rows.sort(key=lambda r: order[r["target"]])

    mode = "quick" if args.quick else "full"
    header = (
        f"whichdevice benchmark, {mode} run of {', '.join(sections)}; "
        f"{started.strftime('%Y-%m-%d %H:%M:%S UTC')}, {duration / 60:.1f} min"
    )
    loads = ", ".join(f"{k} {v['loadavg_1m_before']:.1f}->{v['loadavg_1m_after']:.1f}" for k, v in ctx.load.items())
    failed = [f"{r['target']}: {r['measure']}" for r in ctx.rows if r["verdict"] in ("FAIL", "n/a")]
    text = [header, machine_line(machine), f"load average (1 min) per section: {loads}", "", table(ctx.rows)]
    if "quality" in ctx.data and "checkpoints" in ctx.data["quality"]:
        text += ["", sweep_table(ctx.data["quality"])]
    text += ["", "failing targets: " + ("; ".join(failed) if failed else "none")]
    print("\n".join(text), flush=True)

    doc = {
        "schema": 1,
        "started": started.isoformat(),
        "duration_s": duration,
        "mode": mode,
        "sections": sections,
        "machine": machine,
        "child_env": {"dropped": dropped, "set": {k: env[k] for k in sorted(set(env) - set(os.environ))}},
        "targets": TARGETS,
        "repetitions": {s: ctx.reps(s) for s in REPS if s in sections or (s == "contenders" and "quality" in sections)},
        "load": ctx.load,
        "cli_retried": retried,
        "rows": ctx.rows,
        "failed": failed,
        "data": ctx.data,
        "table": "\n".join(text),
    }
    if not args.no_json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = started.strftime("%Y%m%dT%H%M%SZ")
        payload = json.dumps(doc, indent=2, default=str) + "\n"
        (RESULTS / f"{stamp}.json").write_text(payload)
        (RESULTS / "latest.json").write_text(payload)
        written = [RESULTS / f"{stamp}.json"]
        if not args.quick and not args.only and not args.reps:
            (HERE / "latest.json").write_text(payload)
            written.append(HERE / "latest.json")
        log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in written))
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
