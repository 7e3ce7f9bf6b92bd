"""The ``whichdevice`` command: the report (default), ``check`` for job scripts, ``smoke`` end to end.

Every failure reaches the user as one or two lines on stderr and an exit code (0 fine, 1 the
hardware cannot do it, 2 the request is wrong); ``--debug`` adds the traceback. Options common to
all subcommands (``--json``, ``--task``, ``--device``, ``--simulate``, ``--debug``) work before or
after the subcommand name.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from whichdevice.cli_parser import PROG, _parse, _UsageError
from whichdevice.core.errors import DeviceError, printable
from whichdevice.core.limits import ResourceLimitError, limit_hit, say_limit

__all__ = ["main"]


# --------------------------------------------------------------------------------------- output


# The command's own streams while main() runs (report.streams); None when called piecemeal.
_streams: Any = None


def _emit(text: str, err: bool = False) -> None:
    """Write to the command's stdout (or stderr); a reader that went away (``| head``) is not an error."""
    from whichdevice.report.streams import Streams, write

    streams = _streams if _streams is not None else Streams(sys.stdout, sys.stderr)
    write(streams, text, err=err)


def _out() -> TextIO:
    return _streams.out if _streams is not None else sys.stdout


def _say(message: str, command: str | None = None) -> None:
    prefix = f"{PROG} {command}" if command and command != "report" else PROG
    # A message quotes what came from outside (a device's name, a variable, a report): escaped,
    # so that it cannot clear the screen or forge a line such as "ok: ..." in a job's log.
    _emit(f"{prefix}: {printable(message)}\n", err=True)


def _json(data: Any) -> None:
    _emit(json.dumps(data, indent=2) + "\n")


def _error_json(exc_type: str, message: str, code: int, command: str | None) -> dict[str, Any]:
    from whichdevice.report.gather import SCHEMA_VERSION

    return {
        "kind": "error",
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "error": {"type": exc_type, "message": message, "exit_code": code},
        "exit_code": code,
    }


# ------------------------------------------------------------------------------------ commands


def _tasks(task: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if task is None:
        return default
    if task == "all":
        return ("inference", "training")
    return (task,)


def _check_model(model: str | None) -> None:
    """A --model that cannot be read is the request's fault, said once before any report: the
    report's headline is about devices, and each task's resolution would repeat the same error."""
    if model is not None:
        from whichdevice.model.facts import read_model_facts

        read_model_facts(model, weights=False)


def _cmd_report(args: argparse.Namespace) -> int:
    from whichdevice.report.gather import gather
    from whichdevice.report.render import render_text, terminal_width, use_color

    _check_model(args.model)
    report = gather(
        tasks=_tasks(args.task, ("inference", "training")),
        device=args.device,
        simulate=args.simulate,
        simulate_report=args.simulate_report,
        job={
            "model": args.model,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "max_new_tokens": args.max_new_tokens,
            "devices": args.devices,
        },
    )
    if args.json:
        _json(report)
    else:
        color = use_color(_out())
        _emit(render_text(report, color=color, width=terminal_width(_out()), verbose=args.verbose))
    for r in report["resolutions"]:
        if not r["ok"]:
            # The report shows it in place; stderr says it once more for scripts and logs.
            _say(f"{r['task']}: {r['error']['message']}")
            break
    code: int = report["exit_code"]
    return code


def _cmd_check(args: argparse.Namespace) -> int:
    from whichdevice.device.request import parse_device
    from whichdevice.report.check import check

    # "is not None": an empty DEVICE (check "$UNSET_VAR") is bad input, not "detect one".
    device = args.check_device if args.check_device is not None else args.device
    if args.check_device is not None and args.device is not None and args.check_device != args.device:
        raise DeviceError(f"two devices given (DEVICE {args.check_device!r} and --device {args.device!r}); give one")
    if device is not None:
        parse_device(device, "DEVICE")
    tasks = _tasks(args.task, ("inference",))
    result = check(
        device, tasks=tasks, min_devices=args.min_devices, simulate=args.simulate, simulate_report=args.simulate_report
    )
    code: int = result["exit_code"]
    if args.json:
        _json(result)
    elif code == 0:
        _emit(printable(result["message"]) + "\n")
    if code != 0:
        _say(result["message"], "check")
    return code


def _cmd_smoke(args: argparse.Namespace) -> int:
    from whichdevice.smoke import SMOKE_REFUSAL, render_summary, run_smoke

    if args.simulate:
        raise DeviceError(SMOKE_REFUSAL)
    if args.simulate_report:
        raise DeviceError("smoke runs real hardware; --simulate-report only changes the report and check")

    result = run_smoke(
        tasks=_tasks(args.task, ("inference", "training")),
        device=args.device,
        progress_stream=_streams.err if _streams is not None else sys.stderr,
        debug=args.debug,
    )
    if args.json:
        _json(result)
    elif result["ok"]:
        _emit(render_summary(result))
    if not result["ok"]:
        err = result["error"]
        _say(err["message"], "smoke")
    code: int = result["exit_code"]
    return code


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from whichdevice.measure.calibration import calibration_enabled, run_calibration
    from whichdevice.report.calibration import render_calibration

    if args.simulate:
        raise DeviceError(
            "calibrate times this machine's CPU; a simulated CPU takes its figures from its spec "
            "(--simulate 'cpu,calib=bf16.b1:1.15/bf16.prompt:0.3')"
        )
    # calibrate times the CPU whatever the task or device; an option it would ignore is refused.
    ignored = [flag for flag, value in (("--task", args.task), ("--device", args.device)) if value]
    ignored += ["--simulate-report"] if args.simulate_report else []
    if ignored:
        raise DeviceError(f"calibrate takes no {', '.join(ignored)}: it times this machine's CPU; run it without them")
    from whichdevice.report.gather import SCHEMA_VERSION

    calib = run_calibration(budget_s=5.0)
    if args.json:
        used = calibration_enabled()[0] and not calib.whole_unsteady()
        _json({"kind": "calibration", "schema_version": SCHEMA_VERSION, "used": used, **calib.to_dict()})
    else:
        _emit(render_calibration(calib))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from whichdevice.report.gather import SCHEMA_VERSION
    from whichdevice.report.plan import plan_hardware

    if args.simulate or args.simulate_report or args.device:
        raise DeviceError(
            "plan simulates each machine itself: give machines with --machine SPEC, not --simulate or --device"
        )
    result = plan_hardware(
        args.plan_model,
        task=args.plan_task,
        batch_size=args.plan_batch,
        max_length=args.plan_length,
        machines=args.machine,
        revision=args.revision,
        gradient_checkpointing={"auto": None, "on": True, "off": False}[args.plan_checkpointing],
    )
    if args.json:
        _json({"schema_version": SCHEMA_VERSION, **result.to_dict()})
        return 0
    title = f"{result.model}: {result.task} at batch {result.batch_size} x {result.max_length} tokens"
    lines = [printable(title)] + ([printable(result.fetched)] if result.fetched else [])
    lines += [printable(f"warning: {w}") for w in result.warnings]
    _emit("\n".join(lines) + "\n\n" + result.table())
    return 0


# Commands that run no model: the cyclic garbage collector is paused for their run (see ``_main``).
# The smoke test loads and runs a model, and keeps it.
_COLLECTOR_PAUSED = frozenset({"report", "check", "calibrate", "plan"})

_COMMANDS = {
    "report": _cmd_report,
    "check": _cmd_check,
    "smoke": _cmd_smoke,
    "calibrate": _cmd_calibrate,
    "plan": _cmd_plan,
}


# ---------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Run as the command (``argv`` None), stdout and stderr are guarded at the descriptor level:
    only the command's own output reaches them (see :mod:`whichdevice.report.streams`).
    """
    from whichdevice.report.streams import close, command_streams, write

    global _streams
    descriptors = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    outer = _streams
    try:
        with command_streams(descriptors) as streams:
            _streams = streams
            try:
                code = _main(argv, debug, own_process=descriptors)
            finally:
                _streams = outer
    except (OSError, MemoryError) as exc:  # the streams themselves (ulimit -n, -f): one line, exit 1
        return say_limit(exc, PROG)
    if debug and streams.captured.strip():
        write(streams, "output of other code while the command ran:\n" + streams.captured, err=True)
    if descriptors:
        close(streams)
        _leave(code)
    return code


def _main(argv: list[str], debug: bool, own_process: bool = False) -> int:
    wants_json = "--json" in argv
    command: str | None = None
    try:
        parsed = sys.stdout
        sys.stdout = _out()  # --help and --version print through argparse
        try:
            args = _parse(argv)
        finally:
            sys.stdout = parsed
    except _UsageError as exc:
        return _fail(exc, 2, _subcommand(exc.prog), wants_json, debug=False, usage=exc.prog)
    except SystemExit as exc:  # --help, --version: argparse has printed what was asked
        return exc.code if isinstance(exc.code, int) else 0
    command = args.command
    if own_process and command in _COLLECTOR_PAUSED:
        # The command's own short-lived process: a cyclic collection walks every object torch's import
        # made (80-100 ms of a 160 ms `--json` after `import torch` here; docs/performance.md), and
        # what these commands leave is freed by reference counting. Never done in a caller's process.
        gc.disable()
    try:
        _only_the_report_sizes(command, args)
        with _progress_shown(args.json):
            return _COMMANDS[command](args)
    except DeviceError as exc:
        from whichdevice.core.errors import exit_code_for

        return _fail(exc, exit_code_for(exc), command, args.json, debug=debug)
    except KeyboardInterrupt:
        _say("interrupted", command)
        return 130
    except Exception as exc:
        limit = limit_hit(exc)
        if limit is not None:  # ulimit -v/-n/-f: not a bug, and the fix is the limit's
            return _fail(ResourceLimitError(limit), 1, command, args.json, debug=debug)
        # A bug or a broken installation: still one line and an exit code, the traceback on --debug.
        return _fail(exc, 1, command, args.json, debug=debug, internal=True)


def _progress_shown(wants_json: bool) -> Any:
    """Slow steps (probing, timing the CPU, reading a model) shown on stderr, on a terminal only:
    a log or a pipe gets no half-drawn lines, and --json's reader only the JSON."""
    from whichdevice.core.progress import showing, terminal_sink

    err = _streams.err if _streams is not None else sys.stderr
    try:
        tty = not wants_json and bool(err.isatty())
    except (AttributeError, OSError, ValueError):  # a closed or replaced stream
        tty = False
    return showing(terminal_sink(err, PROG) if tty else None)


def _leave(code: int) -> None:
    """After a failed ``import torch`` the half-imported torch can crash the interpreter on exit
    (SIGSEGV with torch_npu and no CANN), so the command ends here with ``code`` (its output is out)."""
    from whichdevice.hardware.probes.torch_import import torch_import_failed

    if torch_import_failed():
        os._exit(code)


def _only_the_report_sizes(command: str, args: argparse.Namespace) -> None:
    """--model, --batch-size, --max-length and --max-new-tokens are the report's: another command would
    ignore them."""
    options = (
        ("--model", args.model),
        ("--batch-size", args.batch_size),
        ("--max-length", args.max_length),
        ("--max-new-tokens", args.max_new_tokens),
    )
    given = [flag for flag, value in options if value]
    if given and command != "report":
        raise DeviceError(
            f"{command} takes no {', '.join(given)}: they size a model in the report; "
            f"run `whichdevice {' '.join(given)} ...` without {command}"
        )


def _subcommand(prog: str) -> str | None:
    parts = prog.split()
    return parts[1] if len(parts) > 1 else None


def _fail(
    exc: BaseException,
    code: int,
    command: str | None,
    wants_json: bool,
    *,
    debug: bool,
    internal: bool = False,
    usage: str | None = None,
) -> int:
    if debug:
        _emit("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), err=True)
    message = str(exc)
    if internal:
        message = f"internal error: {type(exc).__name__}: {exc}"
    if wants_json:
        _json(_error_json(type(exc).__name__ if not usage else "UsageError", message, code, command))
    if usage is not None:
        _emit(f"{usage}: error: {printable(message)}\n", err=True)
        _emit(f"run '{usage} --help' for the options\n", err=True)
    else:
        _say(message, command)
        if internal and not debug:
            _emit(f"run it again with --debug for the traceback, and report it if it is a bug in {PROG}\n", err=True)
    return code
