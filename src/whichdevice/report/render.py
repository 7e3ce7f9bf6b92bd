"""The report as text a person reads or pastes into an issue; colour and wrapping only on a terminal."""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from collections.abc import Mapping
from typing import Any, ClassVar

from whichdevice.core.errors import printable

__all__ = ["Style", "render_text", "terminal_width", "use_color"]

Report = Mapping[str, Any]


def use_color(stream: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org) or TERM=dumb."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    if env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):
        return False


def terminal_width(stream: Any) -> int | None:
    """The terminal's width when ``stream`` is one (for wrapping), else None (no wrapping)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty and isatty():
            return max(shutil.get_terminal_size((100, 24)).columns, 60)
    except (ValueError, OSError):
        pass
    return None


class Style:
    """ANSI styling that turns into plain text when colour is off."""

    _CODES: ClassVar[dict[str, str]] = {
        "bold": "1",
        "dim": "2",
        "red": "31",
        "green": "32",
        "yellow": "33",
        "cyan": "36",
        "banner": "1;97;45",
    }

    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        codes = ";".join(self._CODES[s] for s in styles)
        return f"\033[{codes}m{text}\033[0m"


_ANSI = re.compile(r"\033\[[0-9;]*m")


def _visible_len(text: str) -> int:
    return len(_ANSI.sub("", text))


class _Writer:
    """Lines with a hanging indent, wrapped to the terminal only when there is one."""

    def __init__(self, style: Style, width: int | None) -> None:
        self.style = style
        self.width = width
        self.lines: list[str] = []

    def line(self, text: str = "", indent: int = 0) -> None:
        # Wrap only plain segments: a styled line is short (headings, labels) or wrapped by
        # the caller through ``pair``.
        if self.width is None or _visible_len(text) <= self.width or "\033" in text:
            self.lines.append(text)
            return
        wrapped = textwrap.wrap(
            text, width=self.width, subsequent_indent=" " * indent, break_on_hyphens=False, break_long_words=False
        )
        self.lines.extend(wrapped or [text])

    def pair(self, label: str, text: str, label_width: int, indent: int = 2, label_style: tuple[str, ...] = ()) -> None:
        """``label`` padded to a column, then ``text`` wrapped under itself."""
        pad = " " * indent
        head = pad + label.ljust(label_width) + "  "
        styled_head = pad + self.style(label.ljust(label_width), *label_style) + "  "
        if self.width is None or len(head) + len(text) <= self.width:
            self.lines.append(styled_head + text)
            return
        room = max(self.width - len(head), 30)
        wrapped = textwrap.wrap(text, width=room, break_on_hyphens=False, break_long_words=False) or [""]
        self.lines.append(styled_head + wrapped[0])
        self.lines.extend(" " * len(head) + w for w in wrapped[1:])

    def heading(self, text: str) -> None:
        if self.lines:
            self.lines.append("")
        self.lines.append(self.style(text, "bold", "cyan") if self.style.color else text.upper())


def render_text(report: Report, *, color: bool = False, width: int | None = None, verbose: bool = False) -> str:
    """The report as text: sections for backends, environment, warnings, resolution, versions. The backends
    that are simply not installed share one line in BACKENDS and in each trace; ``verbose`` lists each."""
    w = _Writer(Style(color), width)
    report = _escaped(report)
    if report["simulated"]:
        sim = report["simulation"]
        given = f"--simulate-report {sim['report']}" if sim.get("report") else f"--simulate {' '.join(sim['specs'])}"
        _banner(w, f"SIMULATED: {given}")
        w.line(w.style(report["simulation"]["notice"], "bold"))
        w.line()
    _headline(w, report)
    _backends(w, report["backends"] if verbose else _collapsed(report["backends"]))
    _environment(w, report["environment"])
    _warnings(w, report["warnings"])
    _resolutions(w, report["resolutions"], verbose)
    _versions(w, report)
    if report["simulated"]:
        w.line()
        _banner(w, "SIMULATED: the devices above are not this machine's")
    return "\n".join(w.lines) + "\n"


def _escaped(data: Any, key: str = "") -> Any:
    """``data`` with every control character in its strings escaped, keys too (a mapping's keys are
    printed, as generate's keywords are): a report holds what devices, the environment and
    (replayed) files said, and none of it may reach the terminal as a command. The explanation keeps
    its line breaks; ``Resolution.explain`` escapes the lines themselves."""
    if isinstance(data, str):
        return "\n".join(map(printable, data.split("\n"))) if key == "explanation" else printable(data)
    if isinstance(data, Mapping):
        return {printable(k) if isinstance(k, str) else k: _escaped(v, k) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_escaped(v) for v in data]
    return data


def _banner(w: _Writer, text: str) -> None:
    w.line(w.style(f" {text} ", "banner") if w.style.color else f"*** {text} ***")


def _headline(w: _Writer, report: Report) -> None:
    s = w.style
    summary = []
    for r in report["resolutions"]:
        if r["ok"]:
            res = r["resolution"]
            summary.append(f"{r['task']}: {s(res['device'], 'bold')} ({_precision(res)}, {_attention(res)})")
        else:
            summary.append(f"{r['task']}: {s('no usable device', 'red', 'bold')}")
    version = report["versions"].get("whichdevice") or ""
    w.line(s(f"whichdevice {version}".strip(), "bold") + " - " + "; ".join(summary))


def _precision(res: dict[str, Any]) -> str:
    """The dtype, and for training the mixed precision the TrainingArguments line passes, so the two agree."""
    dtype = res["dtype"] or "checkpoint dtype"
    mixed = [key for key in ("bf16", "fp16") if (res.get("training_kwargs") or {}).get(key) is True]
    return f"{dtype} weights, {mixed[0]} mixed precision" if mixed else dtype


_MARKS = {"available": "+", "unavailable": "!", "not installed": "-"}
_STATUS_STYLES = {"available": ("green",), "unavailable": ("yellow",), "not installed": ("dim",)}


def _collapsed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with those simply not installed as one row, in the first one's place (hardware/absent.py)."""
    from whichdevice.hardware.absent import absent_kind

    kinds = [absent_kind(row["name"], row["reason"]) if row["status"] == "not installed" else None for row in rows]
    names = {kind: [r["name"] for r, k in zip(rows, kinds, strict=True) if k == kind] for kind in set(kinds) if kind}
    out: list[dict[str, Any]] = []
    for row, kind in zip(rows, kinds, strict=True):
        if kind is None:
            out.append(row)
        elif row["name"] == names[kind][0]:
            listed = ", ".join(names[kind]) if kind == "not installed" else f"{kind}: {', '.join(names[kind])}"
            said = f"{listed} (whichdevice --verbose or --json: each one's install command)"
            out.append({**row, "name": "others", "reason": said, "install_command": "", "version": None})
    return out


def _backends(w: _Writer, rows: list[dict[str, Any]]) -> None:
    w.heading("Backends (detection order)")
    name_width = max(len(row["name"]) for row in rows)
    for row in rows:
        status = row["status"]
        if status == "available":
            pkg = f"{row['package']} {row['version']}" if row["version"] else row["package"]
            detail = f"{row['summary']} [{pkg}]" + (" SIMULATED" if row["simulated"] else "")
        else:
            detail = row["reason"] or ""
            if status == "not installed" and row["install_command"] not in detail:
                # A missing package says how to get it; an installed one's reason names its own fix.
                detail += f" (install: {row['install_command']})"
            if row["version"]:
                detail = f"[{row['package']} {row['version']}] {detail}"
        label = f"{_MARKS[status]} {row['name'].ljust(name_width)}  {status.ljust(13)}"
        w.pair(label, detail, len(label), label_style=_STATUS_STYLES[status])


_VALUE_WIDTH = 12


def _environment(w: _Writer, entries: list[dict[str, Any]]) -> None:
    w.heading("Environment")
    var_width = max(len(e["name"]) for e in entries)
    # Unset visible-devices variables share one line (each is independent: unset means all
    # visible); LOCAL_RANK/RANK/WORLD_SIZE share one only when none is set (they read together).
    partly_set = {e["group"] for e in entries if e["set"] and e["group"] == "distributed"}
    grouped: dict[str, list[str]] = {}
    for e in entries:
        if not e["set"] and e["group"] is not None and e["group"] not in partly_set:
            grouped.setdefault(e["group"], []).append(e["name"])
    done_groups: set[str] = set()
    for e in entries:
        group = e["group"]
        if e["set"] or group not in grouped:
            _variable(w, e, var_width)
        elif group not in done_groups:
            done_groups.add(group)
            _unset_group(w, group, grouped[group], var_width)


def _variable(w: _Writer, e: dict[str, Any], var_width: int) -> None:
    value = "(unset)" if e["value"] is None else repr(e["value"])
    label = e["name"].ljust(var_width) + "  " + value.ljust(_VALUE_WIDTH)
    bad = e["effect"].startswith(("invalid", "hides every"))
    # The value column already says "(unset)"; the JSON keeps the prefix for readers without it.
    effect = e["effect"] if e["set"] else e["effect"].removeprefix("unset: ")
    w.pair(label, effect, len(label), label_style=("yellow",) if bad else (() if e["set"] else ("dim",)))


def _unset_group(w: _Writer, group: str, names: list[str], var_width: int) -> None:
    if group == "visible_devices":
        title, text = "visible devices", f"every device is visible: {', '.join(names)}"
    else:
        title, text = "/".join(names), "a single process (torchrun and accelerate launch set them)"
    label = title.ljust(var_width) + "  " + "(unset)".ljust(_VALUE_WIDTH)
    w.pair(label, text, len(label), label_style=("dim",))


def _warnings(w: _Writer, warnings: list[dict[str, str]]) -> None:
    w.heading("Warnings")
    if not warnings:
        w.line("  none")
    for warning in warnings:
        w.pair(w.style("!", "yellow", "bold"), f"{warning['message']} [{warning['source']}]", 1)


def _resolutions(w: _Writer, resolutions: list[dict[str, Any]], verbose: bool) -> None:
    from whichdevice.core.records import TraceStep
    from whichdevice.hardware.absent import trace_text

    first_trace: list[str] | None = None
    for r in resolutions:
        w.heading(f"Resolution for {r['task']}")
        if not r["ok"]:
            err = r["error"]
            w.pair(w.style("error", "red", "bold"), f"{err['message']} ({err['type']})", 5)
            continue
        _settings(w, r["resolution"])
        # The explanation's header, and the trace's steps (each one kept in the JSON) as explain() prints them.
        steps = [TraceStep(s["topic"], s["message"], s["chosen"]) for s in r["resolution"]["trace"]]
        trace = trace_text(r["explanation"].split("\n", 1)[0], steps, verbose=verbose).splitlines()
        if first_trace is None:
            first_trace = trace[1:]
            for line in trace:
                w.line("  " + line, indent=17)
        else:
            # A second task usually decides the same way; show only the lines where it does not.
            different = [line for line in trace[1:] if line not in first_trace]
            w.line("  " + trace[0] + (": the same trace as above" if not different else ", where it differs:"))
            for line in different:
                w.line("  " + line, indent=17)


def _attention(res: dict[str, Any]) -> str:
    """The attention a resolution passes, or what transformers picks itself (not passed)."""
    name = res.get("attn_implementation")
    if res.get("attn_implementation_passed"):
        return str(name)
    return f"{name}, transformers' own pick" if name else "attention left to transformers"


def _settings(w: _Writer, res: dict[str, Any]) -> None:
    passed = res.get("device_map_passed") is not False  # since schema 1.9: false under ZeRO-3
    settings = [
        f"device={res['device']!r}",
        f"device_map={res['device_map']!r}" if passed else "no device_map (ZeRO-3 places the weights as they load)",
        f"dtype={res['dtype']}",
    ]
    if res.get("attn_implementation_passed"):
        settings.append(f"attn_implementation={res['attn_implementation']!r}")
    else:
        settings.append(_attention(res))
    w.pair("from_pretrained", ", ".join(settings), 17)
    generate = res.get("generate_kwargs")  # since schema 1.5; a replayed older report has none
    if isinstance(generate, dict) and generate:
        w.pair("generate", ", ".join(f"{k}={v!r}" for k, v in generate.items()), 17)
    if res["training_kwargs"] is not None:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in res["training_kwargs"].items()) or "(nothing to add)"
        w.pair("TrainingArguments", kwargs, 17)
    if res["env_set"]:
        w.pair("environment", "; ".join(a["message"] for a in res["env_set"]), 17)


def _versions(w: _Writer, report: Report) -> None:
    w.heading("Versions")
    versions = report["versions"]
    w.line("  " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()), indent=2)
    plat = report["platform"]
    w.line(f"  {plat['system']} {plat['release']} ({plat['machine']})")
    w.line("  words used above (sdpa, mixed precision, compute capability, ...): see docs/glossary.md")
