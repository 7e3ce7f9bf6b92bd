"""accelerate's own settings, which steer Trainer after whichdevice has answered, and the device Trainer takes.

Three of them change a Trainer run without a word to whichdevice (accelerate 1.16, transformers 5.24):

- ``ACCELERATE_USE_CPU``: ``TrainingArguments._setup_devices`` and ``AcceleratorState`` train on the
  CPU when it is true, whatever accelerator is present.
- ``ACCELERATE_MIXED_PRECISION``: ``TrainingArguments`` takes it as its ``mixed_precision`` unless
  ``fp16=True`` or ``bf16=True`` is passed, and the Trainer hands that to its ``Accelerator``.
- the config file ``accelerate config`` writes (``$HF_HOME/accelerate/default_config.yaml``, HF_HOME
  defaulting to ``$XDG_CACHE_HOME/huggingface``, then ``~/.cache/huggingface``): ``accelerate launch``
  reads it and exports its ``mixed_precision`` and ``use_cpu`` as the two variables above. A program
  started with plain ``python`` never reads it.

And in one process ``TrainingArguments`` always takes device index 0 (``cuda:0``, ``xpu:0``, ...;
``torch.cuda.set_device(0)``), wrapping the model in ``nn.DataParallel`` over every visible CUDA
device; only the visible-devices variable, set before the program starts, chooses another device.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from whichdevice.core import envview
from whichdevice.core.errors import ConfigConflictError, DeviceError
from whichdevice.core.records import TraceStep
from whichdevice.launch import launch_strategy
from whichdevice.launch.launch_strategy import LaunchStrategy

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.launch.distributed import DistributedContext

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "ENV_VARIABLES",
    "LAUNCHERS",
    "AccelerateSettings",
    "config_file_path",
    "launch_command",
    "read_accelerate_settings",
    "trainer_device_steps",
]

ENV_USE_CPU = "ACCELERATE_USE_CPU"
ENV_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
# The variables this module reads (the memo key holds them; see whichdevice.resolve.memo). HF_HOME and
# XDG_CACHE_HOME locate the config file; launch_strategy's are the launch's FSDP/DeepSpeed settings.
ENV_VARIABLES = (ENV_USE_CPU, ENV_MIXED_PRECISION, "HF_HOME", "XDG_CACHE_HOME", *launch_strategy.ENV_VARIABLES)
# accelerate's PrecisionType values.
PRECISIONS = ("no", "fp8", "fp16", "bf16")
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
LAUNCHERS = ("torchrun", "accelerate")


def truth(value: str) -> bool | None:
    """accelerate's ``str_to_bool``: these words only (None: accelerate raises ValueError on it)."""
    low = value.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def config_file_path(environ: Mapping[str, str] | None = None) -> str:
    """Where ``accelerate config`` writes, and ``accelerate launch`` reads, the default config."""
    env = envview.environ() if environ is None else environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


@dataclass(frozen=True)
class AccelerateSettings:
    """The two variables as set (None: unset) and what the default config file says."""

    use_cpu: str | None
    mixed_precision: str | None
    config_path: str
    # The file's settings that steer the device and precision (None: no file).
    config: dict[str, Any] | None = None
    config_problem: str | None = None
    # The FSDP or DeepSpeed strategy the launch's variables carry (None: none; Trainer runs DDP).
    strategy: LaunchStrategy | None = None

    @property
    def cpu_forced(self) -> bool:
        return self.use_cpu is not None and truth(self.use_cpu) is True

    @property
    def precision(self) -> str | None:
        """The mixed precision accelerate was told to use: "bf16", "fp16", "fp8", or None.

        "no" counts as not told: ``accelerate launch`` exports it whenever neither its flag nor
        the config file names a precision, so it is accelerate's default, not a choice. A value is
        taken exactly as accelerate's Accelerator takes it (``mixed_precision not in PrecisionType``
        raises for "BF16" or " bf16 "): such a value is one of :meth:`problems`, never followed.
        """
        value = self.mixed_precision
        return value if value in PRECISIONS and value != "no" else None

    def launch_exports(self, key: str) -> str:
        """ "; `accelerate launch` sets it from <file> (key: value)", or "" when the file has no ``key``."""
        if not self.config or key not in self.config:
            return ""
        return f"; `accelerate launch` sets it from {self.config_path} ({key}: {self.config[key]})"

    def problems(self) -> list[str]:
        """What accelerate itself would refuse in the two variables (the config file's problem is apart)."""
        out = []
        if self.use_cpu is not None and truth(self.use_cpu) is None:
            out.append(
                f"{ENV_USE_CPU}={self.use_cpu!r} is not a truth value: TrainingArguments and accelerate "
                f"raise ValueError on it; set it to 1 or 0, or unset it"
            )
        if self.mixed_precision is not None and self.mixed_precision not in PRECISIONS:
            out.append(
                f"{ENV_MIXED_PRECISION}={self.mixed_precision!r} is not one of {', '.join(PRECISIONS)}, spelled "
                "exactly so: accelerate's Accelerator raises 'Unknown mixed_precision mode' on it (accelerate "
                "launch exports the lower-case word); fix or unset it"
            )
        return out


def read_accelerate_settings(environ: Mapping[str, str] | None = None) -> AccelerateSettings:
    """The variables and the default config file, read without importing accelerate."""
    env = envview.environ() if environ is None else environ
    path = config_file_path(env)
    config, problem = _read_config(path)
    strategy = launch_strategy.read_launch_strategy(env)
    use_cpu = env.get(ENV_USE_CPU)
    if strategy is not None and use_cpu is not None and truth(use_cpu) is True:
        strategy = replace(strategy, cpu_forced=f"{ENV_USE_CPU}={use_cpu!r}")
    return AccelerateSettings(use_cpu, env.get(ENV_MIXED_PRECISION), path, config, problem, strategy)


def _read_config(path: str) -> tuple[dict[str, Any] | None, str | None]:
    if not os.path.isfile(path):
        return None, None
    try:
        import yaml  # accelerate's own dependency, as is its config format
    except ImportError:
        return None, f"{path} exists but PyYAML is not installed to read it (pip install pyyaml)"
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        return None, f"accelerate launch cannot read {path}: {exc}; run `accelerate config` again"
    if not isinstance(loaded, dict):
        return None, f"{path} is not a mapping of settings; run `accelerate config` again"
    keys = ("distributed_type", "mixed_precision", "use_cpu", "num_processes", "gpu_ids")
    found = {key: loaded[key] for key in keys if key in loaded}
    # The strategy the file would launch: a DeepSpeed stage, or FSDP's version (the rest stays in the file).
    for section, key in (("deepspeed_config", "zero_stage"), ("fsdp_config", "fsdp_version")):
        inner = loaded.get(section)
        if isinstance(inner, dict) and key in inner:
            found[key] = inner[key]
    return found, None


def settings_steps(
    settings: AccelerateSettings,
    task: str,
    backend: Backend,
    precision: str | None,
    launcher: str | None = None,
) -> list[TraceStep]:
    """The trace lines: what accelerate's variables and config file do to this resolution.

    ``precision`` is the mixed precision whichdevice chose for training ("bf16", "fp16", None);
    ``launcher`` who started this process ("accelerate launch", "torchrun", ...; None: one process).
    """
    problems = [*settings.problems(), *([settings.config_problem] if settings.config_problem else [])]
    steps = [TraceStep("warning", problem) for problem in problems]
    if settings.cpu_forced:
        steps.append(
            TraceStep(
                "accelerate",
                f"{ENV_USE_CPU}={settings.use_cpu!r}: accelerate and Trainer train on the CPU"
                + (" (whichdevice follows it for training)" if task == "training" else "; inference ignores it"),
            )
        )
    asked = settings.precision
    if asked is not None:
        said = f"{ENV_MIXED_PRECISION}={settings.mixed_precision!r}"
        if task != "training":
            steps.append(TraceStep("accelerate", f"{said}: read by Trainer and Accelerator only; inference ignores it"))
        elif asked == precision:
            steps.append(TraceStep("accelerate", f"{said}: the same mixed precision whichdevice chose"))
        else:
            chose = f"{precision} mixed precision" if precision else "fp32"
            follows = (
                f"training_arguments() follows it where {asked} runs on {backend.name} and refuses it where not"
                if asked in ("bf16", "fp16")
                else f"training_arguments() leaves {asked} to accelerate (whichdevice does not check it)"
            )
            steps.append(
                TraceStep(
                    "warning",
                    f"{said} asks accelerate for {asked} while whichdevice chose {chose}: {follows}; "
                    "TrainingArguments(**res.training_kwargs()) overrides it with whichdevice's flags",
                )
            )
    launched = settings.strategy
    if launched is not None and task == "training":
        if launched.problem:
            steps.append(TraceStep("warning", launched.problem))
        steps.append(
            TraceStep(
                "accelerate",
                f"the launch's variables carry {launched.name} ({launched.said}): training_kwargs() passes no "
                "fsdp=/deepspeed= over it (with model= it is sized as launched: see the strategy lines)",
            )
        )
    if settings.config:
        steps.append(TraceStep("accelerate", _config_line(settings, launcher)))
    return steps


def _config_line(settings: AccelerateSettings, launcher: str | None) -> str:
    config = settings.config or {}
    said = ", ".join(f"{k}: {v}" for k, v in config.items())
    exported = (
        f"its mixed_precision, use_cpu and strategy as {ENV_MIXED_PRECISION}, {ENV_USE_CPU} and the "
        "ACCELERATE_USE_FSDP/ACCELERATE_USE_DEEPSPEED settings"
    )
    if launcher is not None and launcher.startswith("accelerate launch"):
        return (
            f"{settings.config_path} ({said}): `accelerate launch` started this process and exported {exported} "
            "from it, or from the file --config_file named; whichdevice reads the exported variables"
        )
    started = f"`{launcher}`" if launcher else "plain `python`"
    return (
        f"{settings.config_path} ({said}) is read by `accelerate launch` only, which exports {exported}; "
        f"this process was started by {started}, which ignores it"
    )


def check_cpu_request(settings: AccelerateSettings, name: str, asked: str, source: str) -> None:
    """Refuse a training request for an accelerator that ``ACCELERATE_USE_CPU`` would overrule."""
    if settings.cpu_forced and name != "cpu":
        where = f"device={asked!r}" if source == "device" else f"{source}={asked!r}"
        raise ConfigConflictError(
            f"{where} for training, but {ENV_USE_CPU}={settings.use_cpu!r} makes TrainingArguments and "
            f"accelerate train on the CPU; unset {ENV_USE_CPU} (`accelerate launch --cpu` or a config with "
            "use_cpu: true exports it) to train on the accelerator, or ask for device='cpu'"
        )


# ----------------------------------------------------------------------- the device Trainer takes


def _visible_variable(backend: Backend, result: ProbeResult) -> str | None:
    vis = result.visible
    if vis is not None and vis.variable:
        return vis.variable
    return backend.visible_devices_env[0] if backend.visible_devices_env else None


def _only(backend: Backend, result: ProbeResult, index: int) -> str:
    """``CUDA_VISIBLE_DEVICES=3``: the setting that shows this process's device ``index`` alone."""
    variable = _visible_variable(backend, result)
    physical = result.visible.physical_id(index) if result.visible is not None else str(index)
    if not variable:
        return f"a {backend.name} setting that shows only device {index}"
    return shlex.quote(f"{variable}={physical}")


def trainer_device_steps(
    backend: Backend,
    result: ProbeResult,
    index: int | None,
    dist: DistributedContext | None,
) -> list[TraceStep]:
    """Check that Trainer trains where whichdevice resolved, and warn where one process leaves devices idle.

    Raises :class:`ConfigConflictError` for a device index that Trainer would not use.
    """
    if backend.shared_device or not _launchable(backend):
        return []
    count = result.device_count
    if dist is not None:
        if index is not None and index != dist.local_rank % max(count, 1):
            raise ConfigConflictError(
                f"device '{backend.name}:{index}' for training in a {dist.launcher} run, but accelerate gives "
                f"each process the device of its local rank ({dist.local_rank_variable}={dist.local_rank} -> "
                f"{backend.name}:{dist.local_rank % max(count, 1)}); leave device out, or choose the "
                f"processes' devices with {_visible_variable(backend, result) or 'its visible-devices variable'} "
                "before launching"
            )
        return []
    if index is not None and index > 0:
        raise ConfigConflictError(
            f"device '{backend.name}:{index}' for training: in one process TrainingArguments always trains on "
            f"{backend.name}:0 (it calls set_device({backend.name}:0)), and the visible-devices variable "
            f"cannot change once torch has initialised {backend.name}. Start the program with that device alone "
            f"visible: {_only(backend, result, index)} python train.py (it is {backend.name}:0 there), or "
            f"run one process per device with `{shlex.join(launch_command(backend, result, ['train.py']))}`"
        )
    if count < 2:
        return []
    # Quoted for a shell: the visible-devices value is copied from the environment as it is.
    launch = shlex.join(launch_command(backend, result, ["train.py"]))
    if backend.name == "cuda":
        what = (
            f"Trainer in one process wraps the model in nn.DataParallel over all {count} visible GPUs "
            "(TrainingArguments.n_gpu = torch.cuda.device_count()), which is slower than one process per GPU"
        )
    else:
        others = "the other device" if count == 2 else f"the other {count - 1}"
        what = f"Trainer in one process trains on {backend.name}:0 only and leaves {others} idle"
    return [TraceStep("warning", f"{what}; launch one process per device: `{launch}` (res.launch_command)")]


def _launchable(backend: Backend) -> bool:
    # A backend with no process group runs one process (mps); torch_xla starts its own processes.
    return backend.distributed_backend not in (None, "xla")


def launch_command(
    backend: Backend,
    result: ProbeResult,
    script: Sequence[str],
    *,
    launcher: str = "torchrun",
    nproc: int | None = None,
) -> list[str]:
    """The argument list that starts ``script`` (``["train.py", "--lr", "1e-4"]``) once per device.

    A visible-devices variable set in this environment is written into the command, so that it
    selects the same devices from any shell: ``["env", "CUDA_VISIBLE_DEVICES=2,3", "torchrun", ...]``.
    """
    if not _launchable(backend):
        raise DeviceError(
            f"no launch command for {backend.name}: "
            + (
                f"{backend.hardware} runs one process"
                if backend.distributed_backend is None
                else "torch_xla starts the processes of a TPU run itself (see torch_xla's documentation)"
            )
        )
    if launcher not in LAUNCHERS:
        raise DeviceError(f"launcher={launcher!r}: use {' or '.join(repr(x) for x in LAUNCHERS)}")
    if not isinstance(script, str) and not (
        isinstance(script, Sequence) and all(isinstance(a, (str, os.PathLike)) for a in script)
    ):
        raise DeviceError(
            f"script={script!r}: give the command as a list of strings, e.g. ['train.py', '--lr', '1e-4']"
        )
    args = [script] if isinstance(script, str) else [str(a) for a in script]
    if not args:
        raise DeviceError("launch_command() needs the script and its arguments, e.g. ['train.py', '--lr', '1e-4']")
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise DeviceError(f"nproc={nproc!r}: pass a whole number of processes, 1 or more")
    count = nproc if nproc is not None else (1 if backend.shared_device else max(result.device_count, 1))
    if launcher == "torchrun":
        command = ["torchrun", f"--nproc-per-node={count}", *args]
    else:
        command = ["accelerate", "launch", "--num_processes", str(count), *args]
    vis = result.visible
    if vis is not None and vis.variable and vis.raw is not None:
        return ["env", f"{vis.variable}={vis.raw}", *command]
    return command
