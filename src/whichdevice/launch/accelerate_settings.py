"""accelerate's own settings, which steer Trainer after whichdevice has answered.

Three of them change a Trainer run without a word to whichdevice (accelerate 1.16, transformers 5.24):

- ``ACCELERATE_USE_CPU``: ``TrainingArguments._setup_devices`` and ``AcceleratorState`` train on the
  CPU when it is true, whatever accelerator is present.
- ``ACCELERATE_MIXED_PRECISION``: ``TrainingArguments`` takes it as its ``mixed_precision`` unless
  ``fp16=True`` or ``bf16=True`` is passed, and the Trainer hands that to its ``Accelerator``.
- the config file ``accelerate config`` writes (``$HF_HOME/accelerate/default_config.yaml``, HF_HOME
  defaulting to ``$XDG_CACHE_HOME/huggingface``, then ``~/.cache/huggingface``): ``accelerate launch``
  reads it and exports its ``mixed_precision`` and ``use_cpu`` as the two variables above. A program
  started with plain ``python`` never reads it.

The device Trainer takes, and the command that launches one process per device, are asked of the
target: device/launch_command.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core import envview
from whichdevice.core.errors import ConfigConflictError, printable
from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import TraceStep
from whichdevice.core.untrusted import UntrustedFileError, read_untrusted
from whichdevice.launch import launch_strategy

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.launch.strategy_record import LaunchStrategy

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "ENV_VARIABLES",
    "LAUNCHERS",
    "AccelerateSettings",
    "config_file_path",
    "read_accelerate_settings",
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
_MAX_CONFIG = 1_000_000  # accelerate config writes about 30 lines; beyond this it is not its file


def truth(value: str) -> bool | None:
    """accelerate's ``str_to_bool``: these words only (None: accelerate raises ValueError on it)."""
    low = value.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def config_file_path(environ: Mapping[str, str] | None = None) -> str:
    """Where ``accelerate config`` writes, and ``accelerate launch`` reads, the default config."""
    env = envview.environ() if environ is None else environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


@frozen_record
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
    # Named by a variable (ACCELERATE_CONFIG_FILE, HF_HOME): read as untrusted, so a FIFO or a device is
    # said, not waited on or read without end.
    try:
        raw = read_untrusted(path, _MAX_CONFIG)
    except FileNotFoundError:
        return None, None
    except UntrustedFileError as exc:
        return None, f"accelerate's config file: {exc}; whichdevice reads the launch from the variables alone"
    try:
        import yaml  # accelerate's own dependency, as is its config format
    except ImportError:
        return None, f"{printable(path)} exists but PyYAML is not installed to read it (pip install pyyaml)"
    try:
        loaded = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        problem = printable(str(exc))
        return None, f"accelerate launch cannot read {printable(path)}: {problem}; run `accelerate config` again"
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
