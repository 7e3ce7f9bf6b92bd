"""The training strategy the launch carries: accelerate's FSDP or DeepSpeed settings, read as Trainer reads them.

``accelerate launch`` turns its config file (``--config_file``, else the default one) and flags into
variables of each process it starts (accelerate 1.16 utils/launch.py:277-305, ``prepare_multi_gpu_env``,
and :526-541, ``prepare_deepspeed_cmd_env``), and transformers and accelerate build the strategy from
them when no keyword says otherwise (installed files, transformers 5.25 and accelerate 1.16):

- DeepSpeed: ``TrainingArguments.__post_init__`` builds ``DeepSpeedPlugin()`` from the variables only
  when ``deepspeed=`` is not passed (transformers/training_args.py:1705-1720: ``if self.deepspeed: ...
  elif strtobool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))``), so a ``deepspeed=`` keyword
  replaces the launch's stage. The plugin takes ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` (default 2), the
  offload devices, or the JSON file ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` names, whose own values win
  where they are not "auto" (accelerate/utils/dataclasses.py:1131-1195, ``DeepSpeedPlugin.__post_init__``,
  ``fill_match``).
- FSDP: Trainer builds ``FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)`` only when ``fsdp=``
  is passed (transformers/trainer.py:851-855); otherwise ``Accelerator`` builds it from
  ``ACCELERATE_USE_FSDP`` (``.lower() == "true"``, accelerate/accelerator.py:372-377) and the ``FSDP_*``
  variables (``FullyShardedDataParallelPlugin.__post_init__``, dataclasses.py:1702-1760). An
  ``fsdp_config=`` of ours would override the launch's version and resharding.
- ``AcceleratorState`` checks DeepSpeed first (accelerate/state.py:935), "and not cpu", where ``cpu`` is
  the ``Accelerator``'s own argument, which Trainer does not pass, or ``ACCELERATE_USE_CPU`` (state.py:876):
  CPU processes run DeepSpeed, unless that variable is true (``LaunchStrategy.cpu_forced``). FSDP is
  taken only for the MULTI_GPU/XPU/NPU/HPU/... types (:971), so a MULTI_CPU run ignores it; but
  ``Accelerator`` builds the plugin from the variables first, and the plugin refuses
  ``sync_module_states=True`` on a CPU (``accelerate launch --use_fsdp``'s default): ``fsdp_plugin_steps``
  builds it as Trainer will, and warns where it raises.

So whichdevice reads the same variables, sizes the strategy they name, warns with the numbers where it
does not fit, and hands over no ``fsdp``/``deepspeed`` keyword while they are set.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from whichdevice.core import envview
from whichdevice.core.errors import printable, shown
from whichdevice.core.numbers import parse_number
from whichdevice.core.records import TraceStep
from whichdevice.core.untrusted import UntrustedFileError, read_untrusted

__all__ = [
    "ENV_VARIABLES",
    "ZERO3_LOADING",
    "LaunchStrategy",
    "fsdp_plugin_steps",
    "partitioned_on_load",
    "read_launch_strategy",
]

# typing's TYPE_CHECKING without importing typing's extras; mypy and ruff read it the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from whichdevice.launch.strategy_record import LaunchStrategy


def __getattr__(name: str) -> Any:
    # The record lives in launch/strategy_record.py, built only where a launch carries a strategy.
    if name == "LaunchStrategy":
        from whichdevice.launch.strategy_record import LaunchStrategy

        return LaunchStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ENV_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ENV_ZERO_STAGE = "ACCELERATE_DEEPSPEED_ZERO_STAGE"
ENV_DEEPSPEED_CONFIG = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ENV_OFFLOAD_OPTIMIZER = "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"
ENV_OFFLOAD_PARAM = "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"
ENV_USE_FSDP = "ACCELERATE_USE_FSDP"
FSDP_VERSION = "FSDP_VERSION"
FSDP_SHARDING = "FSDP_SHARDING_STRATEGY"
FSDP_RESHARD = "FSDP_RESHARD_AFTER_FORWARD"
FSDP_OFFLOAD = "FSDP_OFFLOAD_PARAMS"
# Read by accelerate's FullyShardedDataParallelPlugin, which fsdp_plugin_steps builds (and which writes the
# second one back): declared so that a change of either is a new memo key.
FSDP_PLUGIN_READS = ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING")
# The variables this module reads (the memo key holds them; see whichdevice.resolve.memo).
ENV_VARIABLES = (
    ENV_USE_DEEPSPEED,
    ENV_ZERO_STAGE,
    ENV_DEEPSPEED_CONFIG,
    ENV_OFFLOAD_OPTIMIZER,
    ENV_OFFLOAD_PARAM,
    ENV_USE_FSDP,
    FSDP_VERSION,
    FSDP_SHARDING,
    FSDP_RESHARD,
    FSDP_OFFLOAD,
    *FSDP_PLUGIN_READS,
)
# transformers' strtobool (utils/generic.py): what TrainingArguments reads ACCELERATE_USE_DEEPSPEED with.
_TRUE = ("y", "yes", "t", "true", "on", "1")
# accelerate's FSDP_SHARDING_STRATEGY names (utils/constants.py), 1-based as the plugin numbers them.
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_MAX_CONFIG = 10_000_000  # a DeepSpeed config is a few KiB; beyond this it is not one


def read_launch_strategy(environ: Mapping[str, str] | None = None) -> LaunchStrategy | None:
    """The strategy the launch's variables carry (None: none; Trainer then runs DDP unless a keyword says)."""
    env = envview.environ() if environ is None else environ
    if env.get(ENV_USE_DEEPSPEED, "false").strip().lower() in _TRUE:
        return _deepspeed(env)
    if env.get(ENV_USE_FSDP, "false").lower() == "true":
        return _fsdp(env)
    return None


def _value(text: str) -> str:
    """A variable's value as the trace quotes it: escaped, and cut where it is longer than any real one."""
    return printable(text) if len(text) <= 80 else f"{printable(text[:80])}... ({len(text)} characters)"


def _offloaded(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("cpu", "nvme")


def _deepspeed(env: Mapping[str, str]) -> LaunchStrategy:
    from whichdevice.launch.strategy_record import LaunchStrategy

    said = [f"{ENV_USE_DEEPSPEED}={_value(env[ENV_USE_DEEPSPEED])}"]
    problem = None
    raw = env.get(ENV_ZERO_STAGE)
    stage = 2  # DeepSpeedPlugin's default
    if raw is not None:
        said.append(f"{ENV_ZERO_STAGE}={_value(raw)}")
        number = parse_number(ENV_ZERO_STAGE, raw, maximum=3)
        if number.value is not None:
            stage = number.value
        else:
            problem = f"{ENV_ZERO_STAGE}={shown(raw)} is not a ZeRO stage (0-3): DeepSpeedPlugin's int() raises on it"
    optimizer = _offloaded(env.get(ENV_OFFLOAD_OPTIMIZER))
    params = _offloaded(env.get(ENV_OFFLOAD_PARAM))
    for name in (ENV_OFFLOAD_OPTIMIZER, ENV_OFFLOAD_PARAM):
        if env.get(name) is not None:
            said.append(f"{name}={_value(env[name])}")
    path = env.get(ENV_DEEPSPEED_CONFIG)
    if path is not None and path != "none":
        said.append(f"{ENV_DEEPSPEED_CONFIG}={_value(path)}")
        zero, file_problem = _config_file(path)
        problem = file_problem or problem
        if zero is not None:
            # The file's values win where they are not "auto" (DeepSpeedPlugin's fill_match).
            if zero.get("stage") in (0, 1, 2, 3):
                stage = zero["stage"]
            for key, current in (("offload_optimizer", optimizer), ("offload_param", params)):
                device = zero.get(key, {}).get("device") if isinstance(zero.get(key), dict) else None
                if isinstance(device, str) and device != "auto":
                    current = _offloaded(device)
                if key == "offload_optimizer":
                    optimizer = current
                else:
                    params = current
    return LaunchStrategy("deepspeed", ", ".join(said), stage, "FULL_SHARD", optimizer, params, problem)


def _config_file(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """The ``zero_optimization`` section of a DeepSpeed JSON config (untrusted: read by read_untrusted,
    so a FIFO, a device or a huge file is said, not waited on), or why not."""
    where = f"{ENV_DEEPSPEED_CONFIG}={printable(repr(path))}"
    variables = "whichdevice sizes the variables' stage"
    try:
        loaded = json.loads(read_untrusted(path, _MAX_CONFIG).decode("utf-8"))
    except UntrustedFileError as exc:
        return None, f"{ENV_DEEPSPEED_CONFIG}: {exc}; {variables}"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{where} cannot be read as JSON ({type(exc).__name__}): {variables}"
    zero = loaded.get("zero_optimization") if isinstance(loaded, dict) else None
    if not isinstance(zero, dict):
        return None, f"{where} has no zero_optimization section: DeepSpeedPlugin raises on it"
    return zero, None


def _fsdp(env: Mapping[str, str]) -> LaunchStrategy:
    from whichdevice.launch.strategy_record import LaunchStrategy

    said = [f"{ENV_USE_FSDP}={_value(env[ENV_USE_FSDP])}"]
    for name in (FSDP_VERSION, FSDP_SHARDING, FSDP_RESHARD, FSDP_OFFLOAD):
        if env.get(name) is not None:
            said.append(f"{name}={_value(env[name])}")
    version = env.get(FSDP_VERSION, "1").strip()
    problem = None
    sharding = "FULL_SHARD"
    if version == "2":
        # FSDP2 has no sharding strategy: reshard_after_forward=False keeps the layers gathered, as SHARD_GRAD_OP.
        if env.get(FSDP_RESHARD, "true").strip().lower() in ("false", "0", "no", "n", "f", "off"):
            sharding = "SHARD_GRAD_OP"
    else:
        name = FSDP_SHARDING if FSDP_SHARDING in env else FSDP_RESHARD
        raw = env.get(name, "FULL_SHARD").strip().upper()
        sharding, problem = _sharding(name, raw)
    offload = env.get(FSDP_OFFLOAD, "false").strip().lower() in _TRUE
    return LaunchStrategy("fsdp", ", ".join(said), None, sharding, offload, offload, problem)


def _sharding(name: str, raw: str) -> tuple[str, str | None]:
    """The sharding strategy a name or its 1-based number (as the plugin numbers them) says; FULL_SHARD,
    and the problem, for anything else (a number parsed by parse_number: "²" is no digit here)."""
    if raw in _SHARDING:
        return raw, None
    if raw[:1].isdigit():
        number = parse_number(name, raw, minimum=1, maximum=len(_SHARDING))
        if number.value is not None:
            return _SHARDING[number.value - 1], None
        return "FULL_SHARD", f"{number.problem}: not a sharding strategy; whichdevice sizes FULL_SHARD"
    return "FULL_SHARD", None  # another spelling (a boolean of FSDP_RESHARD_AFTER_FORWARD): the default


def fsdp_plugin_steps() -> list[TraceStep]:
    """A warning where accelerate's ``FullyShardedDataParallelPlugin``, which Trainer's ``Accelerator``
    builds from the launch's variables before anything else, raises on them here; none where it builds.

    Asked of accelerate itself (the plugin built as Accelerator builds it), so its own rules decide:
    on a CPU it refuses ``sync_module_states=True``, which ``accelerate launch --use_fsdp`` sets by
    default. The variable the plugin writes back (``FSDP_CPU_RAM_EFFICIENT_LOADING``) is put back as found.
    """
    try:
        from accelerate.utils import FullyShardedDataParallelPlugin
    except ImportError:
        return []
    found = {name: os.environ.get(name) for name in FSDP_PLUGIN_READS}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            FullyShardedDataParallelPlugin()
    except Exception as exc:  # whatever the plugin raises, Trainer raises
        first = (str(exc).splitlines() or [""])[0][:200]
        return [
            TraceStep(
                "warning",
                f"Trainer will raise building accelerate's FullyShardedDataParallelPlugin from the launch's FSDP "
                f"variables on this machine ({type(exc).__name__}: {printable(first)}); launch with "
                "--fsdp_sync_module_states false --fsdp_cpu_ram_efficient_loading false or --fsdp_version 2 "
                "(or without --use_fsdp: CPU processes train with DDP either way)",
            )
        ]
    finally:
        for name, value in found.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return []


# transformers' from_pretrained under ZeRO-3 builds the model inside deepspeed.zero.Init (set up by
# TrainingArguments' HfDeepSpeedConfig, so build it first) and refuses a device_map: model_kwargs() leaves
# device_map (and max_memory) out.
ZERO3_LOADING = (
    "device_map: none passed: under ZeRO-3 from_pretrained partitions the weights over the ranks as it "
    "loads (deepspeed.zero.Init, once TrainingArguments is built) and refuses a device_map"
)


def partitioned_on_load(planned: str | None, launched: LaunchStrategy | None, launched_run: bool) -> bool:
    """Whether from_pretrained builds the model inside deepspeed.zero.Init (ZeRO-3), where it refuses a
    device_map ("DeepSpeed Zero-3 is not compatible with passing a `device_map`"): in a launched run, the
    plan's ZeRO-3 (``planned``, the chosen strategy's key) or a ZeRO-3 the launch carries and Trainer runs
    (``launched``); anywhere, transformers' own ``is_deepspeed_zero3_enabled()`` now, the check
    from_pretrained makes (true once a TrainingArguments with a stage-3 ``deepspeed=`` config, or under a
    ZeRO-3 launch, is built in this process)."""
    if launched_run:
        if planned == "zero3":
            return True
        if launched is not None and launched.kind == "deepspeed" and launched.stage == 3 and not launched.cpu_forced:
            return True
    # Asked only where transformers' DeepSpeed integration is loaded: nothing else can have set it.
    check = getattr(sys.modules.get("transformers.integrations.deepspeed"), "is_deepspeed_zero3_enabled", None)
    return bool(check()) if callable(check) else False
