"""The ``whichdevice`` command's arguments: subcommands, the options they share, and their checks.

Options common to all subcommands (``--json``, ``--task``, ``--device``, ``--simulate``, ``--debug``)
work before or after the subcommand name.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

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
    "model": None,
    "batch_size": None,
    "max_length": None,
    "max_new_tokens": None,
    "devices": None,
    "verbose": False,
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
        # argparse names the option before this ("argument --batch-size: ..."): say only what it takes.
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of 1 or more")
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


def _job_options() -> _Parser:
    """The report's model options: with --model, the resolutions size that model (and the job, with
    --batch-size, --max-length and --max-new-tokens) and say the longest length and largest batch that fit."""
    job = _Parser(add_help=False)
    group = job.add_argument_group("the model and job to size (report only)")
    group.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help="a local model folder or a cached model id, as resolve_device(model=) takes it",
    )
    group.add_argument(
        "--devices",
        default=argparse.SUPPRESS,
        metavar="LIST",
        help="use only these devices, as resolve_device(devices=) takes them: a count (2), indices (0,2), -1 for all",
    )
    for flag, what in (
        ("--batch-size", "sequences run together"),
        ("--max-length", "tokens per sequence, prompt included"),
        ("--max-new-tokens", "tokens each sequence generates"),
    ):
        group.add_argument(flag, type=_positive_int, default=argparse.SUPPRESS, metavar="N", help=what)
    job.add_argument_group("the report's text").add_argument(
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="list each backend that is not installed on its own line, with its install command (default: one line)",
    )
    return job


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    common, job = _common_options(), _job_options()
    parser = _Parser(
        prog=PROG,
        parents=[common, job],
        description=(
            "Which device, dtype and attention this Transformers program should use here, and why. "
            "Without a subcommand: the report to paste into a bug report."
        ),
        epilog="exit codes: 0 fine, 1 the hardware cannot do it, 2 bad input",
    )
    from whichdevice import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{report,check,smoke,calibrate,plan}", parser_class=_Parser)
    sub.add_parser(
        "report",
        parents=[common, job],
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
    _plan_parser(sub)
    return parser


def _plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="which hardware a model's job needs: a table over common machines (a Hub id is read from its metadata)",
        description=(
            "Resolves the job on each machine (simulate() specs: T4 to H200, MI300X, Gaudi, TPU v5e, Trainium, "
            "an Apple M-series Mac and this machine by default) with 1, 2, 4 and 8 devices until it runs: fits, "
            "dtype and quantization, strategy, the largest context and batch, and the decode speed limit. A Hub "
            "model id is read from its config and safetensors headers, never its weights."
        ),
        epilog="exit codes: 0 answered (whether or not anything fits), 2 bad input or the model cannot be read",
    )
    plan.add_argument("plan_model", metavar="MODEL", help="a Hub model id (org/name), a local folder or a cached id")
    plan.add_argument("--task", dest="plan_task", choices=("inference", "training"), default="inference")
    plan.add_argument("--batch-size", dest="plan_batch", type=_positive_int, default=1, metavar="N")
    plan.add_argument("--max-length", dest="plan_length", type=_positive_int, default=4096, metavar="N")
    plan.add_argument("--revision", default=None, help="the Hub revision (branch, tag or commit; default main)")
    plan.add_argument(
        "--gradient-checkpointing",
        dest="plan_checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="training: 'auto' turns it on where the job fits only with it (default); 'on' or 'off' pins it",
    )
    plan.add_argument(
        "--machine",
        action="append",
        default=None,
        metavar="SPEC",
        help="a machine as a simulate() spec ('cuda:1,name=NVIDIA L4'; repeatable); replaces the default list",
    )
    plan.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    plan.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    for name, default in _DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, list(default) if isinstance(default, list) else default)
    if args.command is None:
        args.command = "report"
    return args
