"""The ``whichdevice`` command: the report (default), ``check`` for job scripts, ``smoke`` end to end.

Every failure reaches the user as one or two lines on stderr and an exit code (0 fine, 1 the
hardware cannot do it, 2 the request is wrong); ``--debug`` adds the traceback. Options common to
all subcommands (``--json``, ``--task``, ``--device``, ``--simulate``, ``--debug``) work before or
after the subcommand name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from whichdevice.core.errors import DeviceError, printable
from whichdevice.core.limits import ResourceLimitError, limit_hit, say_limit

__all__ = ["main"]

PROG = "whichdevice"
TASK_CHOICES = ("inference", "training", "all")

# The defaults of the common options, filled in after parsing: the options are declared with
# SUPPRESS so that a subparser does not overwrite a value given before the subcommand name.
_DEFAULTS: dict[str, Any] = {
    "json": False,
    "task": None,
    "device": None,
    "simulate": [],
    "simulate_report": None,
    "debug": False,
}


class _UsageError(Exception):
    """A command line argparse rejected (exit 2)."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; a wrong option deserves one line that
    # names it and where help is, through the same error path as every other failure.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, self.prog)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of devices of 1 or more")
    return value


def _common_options() -> _Parser:
    common = _Parser(add_help=False)
    group = common.add_argument_group("options of every subcommand")
    group.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable output (schema: whichdevice/report_schema.json; no colour)",
    )
    group.add_argument(
        "--task",
        choices=TASK_CHOICES,
        default=argparse.SUPPRESS,
        help="resolve for inference, training or both (default: both; check: inference)",
    )
    group.add_argument(
        "--device",
        metavar="DEVICE",
        default=argparse.SUPPRESS,
        help="resolve this device (cuda, cuda:1, hpu, cpu, ...) instead of detecting one",
    )
    group.add_argument(
        "--simulate",
        metavar="SPEC",
        action="append",
        default=argparse.SUPPRESS,
        help="pretend this hardware is here, e.g. hpu:8 or 'cuda:8,cc=9.0' (repeatable); the output says SIMULATED",
    )
    group.add_argument(
        "--simulate-report",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="replay the machine that wrote FILE (whichdevice --json > FILE there); the output says SIMULATED",
    )
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    common = _common_options()
    parser = _Parser(
        prog=PROG,
        parents=[common],
        description=(
            "Which device, dtype and attention this Transformers program should use here, and why. "
            "Without a subcommand: the report to paste into a bug report."
        ),
        epilog="exit codes: 0 fine, 1 the hardware cannot do it, 2 bad input",
    )
    from whichdevice import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{report,check,smoke,calibrate}", parser_class=_Parser)
    sub.add_parser(
        "report",
        parents=[common],
        help="the full report (the default)",
        description="Backends, the environment that steers device choice, warnings, the resolution, versions.",
    )
    check = sub.add_parser(
        "check",
        parents=[common],
        help="exit 0 if the device is usable, 1 if not (for job scripts)",
        description="For job scripts: whichdevice check cuda --min-devices 8 || exit 1",
        epilog="exit codes: 0 usable, 1 not usable (the reason on stderr), 2 bad input",
    )
    check.add_argument(
        "check_device", nargs="?", metavar="DEVICE", help="the device to check (default: the resolved one)"
    )
    check.add_argument(
        "--min-devices",
        type=_positive_int,
        default=1,
        metavar="N",
        help="also require at least N visible devices of that backend",
    )
    sub.add_parser(
        "smoke",
        parents=[common],
        help="load, generate and train a tiny model on the resolved device",
        description=(
            "Proves the resolution works end to end with nothing to download: a tiny Llama built from a "
            "config, saved, loaded with the resolved settings, generating and training a few steps."
        ),
    )
    sub.add_parser(
        "calibrate",
        parents=[common],
        help="time this CPU's fp32, bf16 and fp16 (about a second) and cache the figures",
        description=(
            "Runs or refreshes the CPU calibration that decides the CPU's dtype and decode attention, "
            "and prints its figures. WHICHDEVICE_CALIBRATION=off turns calibration off; another value "
            "is the folder of its cache."
        ),
    )
    return parser


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    for name, default in _DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, list(default) if isinstance(default, list) else default)
    if args.command is None:
        args.command = "report"
    return args


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


def _cmd_report(args: argparse.Namespace) -> int:
    from whichdevice.report.gather import gather
    from whichdevice.report.render import render_text, terminal_width, use_color

    report = gather(
        tasks=_tasks(args.task, ("inference", "training")),
        device=args.device,
        simulate=args.simulate,
        simulate_report=args.simulate_report,
    )
    if args.json:
        _json(report)
    else:
        color = use_color(_out())
        _emit(render_text(report, color=color, width=terminal_width(_out())))
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
    from whichdevice.hardware.calibration import calibration_enabled, render_calibration, run_calibration

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
    from whichdevice.report import SCHEMA_VERSION

    calib = run_calibration(budget_s=5.0)
    if args.json:
        used = calibration_enabled()[0] and not calib.unsteady
        _json({"kind": "calibration", "schema_version": SCHEMA_VERSION, "used": used, **calib.to_dict()})
    else:
        _emit(render_calibration(calib))
    return 0


_COMMANDS = {"report": _cmd_report, "check": _cmd_check, "smoke": _cmd_smoke, "calibrate": _cmd_calibrate}


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
                code = _main(argv, debug)
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


def _main(argv: list[str], debug: bool) -> int:
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
    try:
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


def _leave(code: int) -> None:
    """After a failed ``import torch`` the half-imported torch can crash the interpreter on exit
    (SIGSEGV with torch_npu and no CANN), so the command ends here with ``code`` (its output is out)."""
    from whichdevice.hardware.probes.common import torch_import_failed

    if torch_import_failed():
        os._exit(code)


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
