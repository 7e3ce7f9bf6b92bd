"""The resolver's opening steps: the request (the arguments checked, model= read once, the device asked
for, the one training follows), the chosen backend's environment, the CPU's calibration. Each returns
its value and its trace lines; ``_resolve`` runs them in order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.core.frozen import NamedTuple
from whichdevice.core.job import Job
from whichdevice.core.packages import stack_problems
from whichdevice.core.records import Trace, TraceStep
from whichdevice.device.request import DeviceRequest, read_request
from whichdevice.device.selection import DevicesAsked, parse_devices
from whichdevice.hardware.envhooks import EnvAction, apply_env_defaults
from whichdevice.hardware.probes.nvidia_platforms import platform_steps
from whichdevice.launch.accelerate_settings import (
    ENV_USE_CPU,
    AccelerateSettings,
    check_cpu_request,
    read_accelerate_settings,
)
from whichdevice.resolve.arguments import Arguments, check_arguments, check_shapes

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.measure.calibration import Calibration
    from whichdevice.model.facts import ModelFacts

__all__ = ["Request", "calibration_step", "environment_step", "request_stage", "training_request"]


def training_request(
    request: DeviceRequest, task: str, settings: AccelerateSettings
) -> tuple[DeviceRequest, list[TraceStep]]:
    """ACCELERATE_USE_CPU puts TrainingArguments and accelerate on the CPU: training follows it."""
    if task != "training" or not settings.cpu_forced:
        return request, []
    if not request.detect:
        check_cpu_request(settings, request.name, request.asked or request.name, request.source)
        return request, []
    step = TraceStep(
        "request",
        f"{ENV_USE_CPU}={settings.use_cpu!r}: training on the CPU, where accelerate and Trainer "
        "will run (beats detection)",
    )
    return DeviceRequest(ENV_USE_CPU, "cpu", "cpu"), [step]


def environment_step(target: Target) -> tuple[tuple[EnvAction, ...], list[TraceStep]]:
    """The env hooks of the chosen backend, and the warnings everything below depends on."""
    env_set = tuple(target.probe.env_set) + apply_env_defaults(target.backend, "select")
    steps = [TraceStep("env", action.message) for action in env_set]
    # A hook that kept the user's value is in the probe's warnings too (the report shows those): said once here.
    said = {action.message for action in env_set}
    steps += [TraceStep("warning", warning) for warning in target.probe.warnings if warning not in said]
    steps += platform_steps(target.probe)  # NVIDIA on ARM64: which machine, and where its PyTorch comes from
    # Everything resolved here is handed to transformers and torch: say what they lack before it fails there.
    steps += [TraceStep("warning", problem) for problem in stack_problems()]
    return env_set, steps


def calibration_step(target: Target, args: Arguments) -> tuple[Calibration | None, list[TraceStep]]:
    """The CPU's measured speeds (whichdevice.measure.calibration): measured on first need when the dtype is
    "auto", else read from the cache only."""
    if target.name != "cpu":
        return None, []
    from whichdevice.measure.calibration import calibration

    auto = isinstance(args.dtype, str) and args.dtype == "auto"
    calib, why = calibration(measure=auto)
    if calib is None:
        return None, [TraceStep("calibration", f"not used: {why}; the CPU's flags decide")] if auto else []
    return calib, [TraceStep("calibration", f"{calib.summary()} ({why})")]


class Request(NamedTuple):
    """What was asked: the arguments as checked, ``model=`` as read, the job the caller described,
    accelerate's settings as read, the device asked for (or detection), and ``devices=`` as parsed."""

    args: Arguments
    model: ModelFacts | None
    job: Job
    device: DeviceRequest
    accelerate: AccelerateSettings
    devices: DevicesAsked | None


def request_stage(args: Arguments) -> tuple[Request, list[TraceStep]]:
    """The arguments checked (their values, then model= read once and checked for damage, then their
    shapes), and the device the request names or leaves to detection."""
    check_arguments(args)
    devices = parse_devices(args.devices)  # its form, before anything is probed
    model = _read_model(args.model, args.revision)
    check_shapes(args)
    trace = Trace()
    if model is not None and model.hub is not None:
        trace.append(TraceStep("model", model.hub.describe()))
    accelerate = read_accelerate_settings()
    device = trace.take(training_request(trace.take(read_request(args.device)), args.task, accelerate))
    return Request(args, model, args.job(), device, accelerate, devices), trace


def _read_model(model: Any, revision: str | None) -> ModelFacts | None:
    if model is None:
        return None
    from whichdevice.model.facts import read_model_facts  # no model=, no model module loaded

    return read_model_facts(model, revision=revision)
