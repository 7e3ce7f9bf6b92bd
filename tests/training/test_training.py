"""training_arguments(): a real TrainingArguments that matches the resolution, and refuses conflicts."""

from __future__ import annotations

import re

import pytest

import whichdevice as wd
from whichdevice.testing import simulate
from whichdevice.training.simulated import SimulatedTrainingError

# TrainingArguments exports ACCELERATE_* variables by design (see conftest.py)
pytestmark = pytest.mark.usefixtures("restore_accelerate_variables")


def test_training_arguments_on_this_machine(tmp_path, cpu_kind):
    res = wd.resolve_device(task="training")
    args = wd.training_arguments(output_dir=str(tmp_path), report_to=[])
    assert str(args.device) == res.device == "cpu"
    assert args.use_cpu is True
    # fp32 weights under bf16 mixed precision exactly where the probe says bf16 is native; never fp16 on a CPU
    assert res.dtype_name == "float32"
    assert res.training_kwargs()["bf16"] is (cpu_kind.dtype == "bfloat16")
    assert args.bf16 is (cpu_kind.dtype == "bfloat16")
    assert args.fp16 is False
    assert args.ddp_backend is None


def test_user_kwargs_are_never_overridden(tmp_path):
    args = wd.training_arguments(output_dir=str(tmp_path), bf16=False, learning_rate=1e-3, report_to=[])
    assert args.bf16 is False and args.fp16 is False
    assert args.learning_rate == 1e-3


def test_bf16_on_a_cpu_without_native_bf16_runs_with_a_warning(tmp_path):
    """It works, slowly: the user's choice is kept and this CPU's own measured cost is said, not refused."""
    measured = r"measured on this CPU \(whichdevice's calibration\): a prompt-sized bf16 matmul runs at 0.03x"
    with simulate("cpu,flags=,calib=bf16.prompt:0.0306"), pytest.warns(UserWarning, match=measured) as caught:
        args = wd.training_arguments(output_dir=str(tmp_path), bf16=True, report_to=[])
    assert args.bf16 is True and args.fp16 is False
    assert "(32.7x the time)" in str(caught[0].message)
    # Not calibrated: no figure from another machine, but where to measure one.
    with simulate("cpu,flags="), pytest.warns(UserWarning, match="not measured on this CPU") as caught:
        wd.training_arguments(output_dir=str(tmp_path), bf16=True, report_to=[])
    assert not re.search(r"\d\.\d+x", str(caught[0].message))


@pytest.mark.parametrize(
    ("spec", "flag", "match"),
    [
        ("cuda:1,cc=7.5,name=Tesla T4", "bf16", "runs emulated and slowly"),
        ("cpu,flags=avx512_bf16", "fp16", "no loss scaler on the CPU"),
        ("cpu,flags=", "fp16", "no loss scaler on the CPU"),
    ],
)
def test_precision_that_runs_at_a_cost_is_warned_not_refused(tmp_path, spec, flag, match):
    from whichdevice.precision.training import precision_conflicts
    from whichdevice.resolve.resolver import resolve_device

    with simulate(spec):
        res = resolve_device(task="training")
        (message,) = precision_conflicts(res.target, {flag: True})
    assert match in message


def test_accelerate_state_is_kept_when_configured(tmp_path):
    from accelerate.state import PartialState

    PartialState(cpu=True)
    try:
        before = dict(PartialState._shared_state)
        args = wd.training_arguments(output_dir=str(tmp_path), report_to=[])
        assert args.accelerator_config.use_configured_state is False  # consumed by TrainingArguments
        assert str(args.device) == "cpu"
        assert PartialState._shared_state.keys() == before.keys()
        assert PartialState._shared_state["device"] == before["device"]
    finally:
        PartialState._reset_state()


@pytest.mark.slow
def test_trainer_runs_real_steps(tmp_path):
    from transformers import AutoModelForCausalLM, Trainer

    from tiny_models import RandomTokens, save_tiny_llama

    path = save_tiny_llama(tmp_path / "model", tokenizer=False)
    res = wd.resolve_device(task="training", model=path)
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs(dtype=None))
    args = wd.training_arguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    assert str(args.device) == res.device
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    result = trainer.train()
    assert result.global_step == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)


# ------------------------------------------------------------------ the device Trainer really uses


def test_use_cpu_true_on_a_gpu_machine_trains_on_the_cpu(tmp_path):
    with simulate("cuda:2"):
        args = wd.training_arguments(str(tmp_path), use_cpu=True, report_to=[])
        assert wd.resolve_device(task="training").device == "cuda:0"  # without use_cpu: the GPU
    assert args.use_cpu is True and str(args.device) == "cpu"


@pytest.mark.parametrize(
    ("spec", "visible", "device", "fix"),
    [
        ("cuda:2", None, "cuda:1", "CUDA_VISIBLE_DEVICES=1 python train.py"),
        ("cuda:4", ("CUDA_VISIBLE_DEVICES", "2,3"), "cuda:1", "CUDA_VISIBLE_DEVICES=3 python train.py"),
        ("cuda:2,variant=rocm", None, "cuda:1", "CUDA_VISIBLE_DEVICES=1 python train.py"),
        ("xpu:2", None, "xpu:1", "ZE_AFFINITY_MASK=1 python train.py"),
    ],
)
def test_a_device_index_trainer_would_not_use_is_refused(tmp_path, monkeypatch, spec, visible, device, fix):
    """TrainingArguments in one process always set_device(<name>:0) (transformers 5.24
    _setup_devices), so cuda:1 would silently train on cuda:0: refused, with the launch that works."""
    if visible:
        monkeypatch.setenv(*visible)
    with simulate(spec):
        assert wd.resolve_device(device).device == device  # inference places a model there itself
        with pytest.raises(wd.ConfigConflictError) as err:
            wd.resolve_device(device, task="training")
        with pytest.raises(wd.ConfigConflictError):
            wd.training_arguments(str(tmp_path), device=device)
    text = str(err.value)
    assert fix in text and "always trains on" in text and "--nproc-per-node=" in text


def test_in_a_torchrun_run_the_device_is_the_local_ranks(monkeypatch):
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with simulate("cuda:2"):
        with pytest.raises(wd.ConfigConflictError, match="LOCAL_RANK=0 -> cuda:0"):
            wd.resolve_device("cuda:1", task="training")
        assert wd.resolve_device("cuda:0", task="training").device == "cuda:0"
        # one process of several: no DataParallel warning
        assert "DataParallel" not in wd.resolve_device(task="training").explain()


def test_one_process_on_several_gpus_warns_and_gives_the_launch_command():
    with simulate("cuda:4"):
        res = wd.resolve_device(task="training")
        inference = wd.resolve_device()
        from whichdevice import report

        data = report.gather(simulate=["cuda:4"])
    warning = next(s.message for s in res.trace if s.topic == "warning" and "DataParallel" in s.message)
    assert "over all 4 visible GPUs" in warning and "`torchrun --nproc-per-node=4 train.py`" in warning
    assert "DataParallel" not in inference.explain()  # inference places the model, no wrapping
    assert any("DataParallel" in w["message"] for w in data["warnings"] if w["source"] == "resolution:training")
    assert res.launch_command(["train.py", "--lr", "1e-4"]) == [
        "torchrun",
        "--nproc-per-node=4",
        "train.py",
        "--lr",
        "1e-4",
    ]
    assert res.launch_command("train.py", launcher="accelerate", nproc=2) == [
        "accelerate",
        "launch",
        "--num_processes",
        "2",
        "train.py",
    ]
    with pytest.raises(wd.DeviceError, match="'torchrun' or 'accelerate'"):
        res.launch_command(["train.py"], launcher="deepspeed")
    with pytest.raises(wd.DeviceError, match="1 or more"):
        res.launch_command(["train.py"], nproc=0)


def test_the_launch_command_carries_the_visible_devices_variable(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    with simulate("cuda:4"):
        res = wd.resolve_device(task="training")
    assert res.launch_command(["train.py"]) == [
        "env",
        "CUDA_VISIBLE_DEVICES=1,3",
        "torchrun",
        "--nproc-per-node=2",
        "train.py",
    ]


@pytest.mark.parametrize(("spec", "idle"), [("hpu:8", "the other 7"), ("xpu:2", "the other device")])
def test_other_backends_leave_devices_idle(spec, idle):
    with simulate(spec):
        trace = wd.resolve_device(task="training").explain()
    assert f"leaves {idle} idle" in trace and "torchrun --nproc-per-node=" in trace


def test_no_launch_command_where_one_process_is_all(tmp_path):
    with simulate("mps"), pytest.raises(wd.DeviceError, match="runs one process"):
        wd.resolve_device(task="training").launch_command(["train.py"])
    with simulate("cuda:1"):
        assert "DataParallel" not in wd.resolve_device(task="training").explain()


# ------------------------------------------------------------------ accelerate's own settings


def test_accelerate_use_cpu_is_followed_for_training_and_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    with simulate("cuda:2"):
        training = wd.resolve_device(task="training")
        inference = wd.resolve_device()
        args = wd.training_arguments(str(tmp_path), report_to=[])
        with pytest.raises(wd.ConfigConflictError, match="unset ACCELERATE_USE_CPU"):
            wd.resolve_device("cuda:0", task="training")
    assert training.device == "cpu" and training.source == "ACCELERATE_USE_CPU"
    assert "ACCELERATE_USE_CPU='1': training on the CPU" in training.explain()
    assert inference.device == "cuda:0" and "ACCELERATE_USE_CPU='1'" in inference.explain()
    assert str(args.device) == "cpu"


def test_an_invalid_accelerate_use_cpu_is_refused_before_transformers_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")
    assert "not a truth value" in wd.resolve_device(task="training").explain()
    with pytest.raises(wd.ConfigConflictError, match="set it to 1 or 0"):
        wd.training_arguments(str(tmp_path))


def test_accelerate_mixed_precision_is_followed_where_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with simulate("cuda:1"):  # an A100: whichdevice's own choice is bf16
        res = wd.resolve_device(task="training")
        with pytest.raises(SimulatedTrainingError) as err:
            wd.training_arguments(str(tmp_path), report_to=[])
    assert "ACCELERATE_MIXED_PRECISION='fp16' asks accelerate for fp16 while whichdevice chose bf16" in res.explain()
    assert err.value.kwargs["fp16"] is True and err.value.kwargs["bf16"] is False


def test_accelerate_mixed_precision_that_cannot_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with simulate("neuron:2"), pytest.raises(wd.ConfigConflictError) as err:
        wd.training_arguments(str(tmp_path))
    text = str(err.value)
    assert "ACCELERATE_MIXED_PRECISION='fp16'" in text and "fp16=True does not work on neuron" in text
    assert "Unset ACCELERATE_MIXED_PRECISION" in text and "default_config.yaml" in text


def test_accelerate_mixed_precision_no_is_accelerates_default(tmp_path, monkeypatch, cpu_kind):
    """ "no" is what accelerate launch exports when nothing names a precision: whichdevice's choice stands."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    args = wd.training_arguments(str(tmp_path), report_to=[])
    native = cpu_kind.dtype == "bfloat16"
    assert args.bf16 is native and args.mixed_precision == ("bf16" if native else "no")


def test_accelerate_mixed_precision_fp8_is_left_to_accelerate(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with simulate("cuda:1"):
        res = wd.resolve_device(task="training")
        with pytest.raises(SimulatedTrainingError) as err:
            wd.training_arguments(str(tmp_path), report_to=[])
    # neither flag: TrainingArguments takes the variable, and accelerate checks fp8 itself
    assert err.value.kwargs["bf16"] is False and err.value.kwargs["fp16"] is False
    assert "leaves fp8 to accelerate" in res.explain()


def test_the_config_accelerate_launch_reads_is_reported(tmp_path, monkeypatch):
    from whichdevice import report

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    config = tmp_path / "accelerate" / "default_config.yaml"
    config.parent.mkdir()
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\nuse_cpu: false\n"
    )
    trace = wd.resolve_device(task="training").explain()
    assert str(config) in trace and "mixed_precision: bf16" in trace
    assert "this process was started by plain `python`, which ignores it" in trace
    entries = {e["name"]: e for e in report.gather()["environment"]}
    assert (
        f"`accelerate launch` sets it from {config} (mixed_precision: bf16)"
        in entries["ACCELERATE_MIXED_PRECISION"]["effect"]
    )
    config.write_text("mixed_precision: [bf16\n")
    data = report.gather()
    assert any("cannot read" in w["message"] and str(config) in w["message"] for w in data["warnings"])


def test_a_changed_accelerate_variable_is_a_new_resolution(monkeypatch):
    first = wd.resolve_device(task="training")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    second = wd.resolve_device(task="training")
    assert second is not first and "fp8" in second.explain()


def test_the_resolutions_torch_compile_reaches_the_arguments(tmp_path):
    # Issue #25: training_arguments(resolution=res) built torch_compile=False although
    # res.training_kwargs() said True.
    res = wd.resolve_device("cpu", task="training", torch_compile=True)
    assert res.training_kwargs()["torch_compile"] is True
    args = wd.training_arguments(str(tmp_path), resolution=res, report_to="none")
    assert args.torch_compile is True
    # Yours wins, as every keyword does.
    mine = wd.training_arguments(str(tmp_path), resolution=res, torch_compile=False, report_to="none")
    assert mine.torch_compile is False


def test_training_arguments_builds_on_the_resolution_without_reading_again(tmp_path, monkeypatch):
    from whichdevice.training import arguments

    res = wd.resolve_device("cpu", task="training")
    calls = []
    monkeypatch.setattr(arguments, "read_accelerate_settings", lambda: calls.append("settings"))
    monkeypatch.setattr(arguments, "refuse_leftovers", lambda found: calls.append("leftovers"))
    wd.training_arguments(str(tmp_path), resolution=res, report_to="none")
    assert calls == []  # resolve_device(task="training") read the settings and ran the launch checks
    inference = wd.resolve_device("cpu")
    wd.training_arguments(str(tmp_path), resolution=inference, report_to="none")
    assert calls == ["leftovers"]  # a resolution made for inference never ran them


# ------------------------------------------------------------------ a training script in a user's CI


def _users_training_script(out: str) -> tuple[wd.Resolution, dict[str, object]]:
    """What a user's train.py does up to the Trainer (the model and data left out)."""
    res = wd.resolve_device(task="training")
    try:
        args = wd.training_arguments(out, per_device_train_batch_size=8, report_to=[])
    except SimulatedTrainingError as exc:  # under simulate(): the decision, not a TrainingArguments
        return res, exc.kwargs
    return res, {"use_cpu": args.use_cpu, "bf16": args.bf16, "fp16": args.fp16}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cuda:1,cc=8.0,mem=80GiB", {"bf16": True, "fp16": False}),
        ("cuda:1,cc=7.5,mem=16GiB,name=Tesla T4", {"bf16": False, "fp16": True}),
        ("hpu:8,gen=gaudi3", {"bf16": True, "fp16": False}),
        ("npu:1", {"bf16": True, "fp16": False}),
        ("xpu:1", {"bf16": True, "fp16": False}),
    ],
)
def test_training_arguments_under_simulate_is_a_device_error_carrying_the_decision(tmp_path, spec, expected):
    # Before: transformers' "Your setup doesn't support bf16/gpu", or a CPU TrainingArguments with fp16=True.
    with simulate(spec):
        res, kwargs = _users_training_script(str(tmp_path))
        with pytest.raises(wd.DeviceError) as err:
            wd.training_arguments(str(tmp_path))
    assert {k: kwargs[k] for k in expected} == expected and kwargs["per_device_train_batch_size"] == 8
    assert "use_cpu" not in kwargs
    assert kwargs["bf16"] == res.training_kwargs()["bf16"] and kwargs["fp16"] == res.training_kwargs()["fp16"]
    text = str(err.value)
    assert "simulated" in text and ".kwargs" in text and "launch_command" in text
    assert "doesn't support bf16/gpu" not in text


def test_a_simulated_cpu_builds_the_real_training_arguments(tmp_path):
    with simulate("cpu,flags="):
        res, kwargs = _users_training_script(str(tmp_path))
    assert kwargs == {"use_cpu": True, "bf16": False, "fp16": False} and res.backend.name == "cpu"


@pytest.mark.usefixtures("restore_accelerate_variables")
def test_use_cpu_false_on_a_cpu_only_machine_is_accepted_and_said(tmp_path):
    # use_cpu=False is TrainingArguments' own default: on a machine with only a CPU it trains there anyway.
    with simulate("cpu,flags=avx512_bf16"), pytest.warns(UserWarning, match="use_cpu=False kept.*bf16=False"):
        args = wd.training_arguments(str(tmp_path), use_cpu=False, report_to=[])
    assert args.use_cpu is False and args.bf16 is False and str(args.device) == "cpu"
    with simulate("cpu,flags="), pytest.warns(UserWarning, match="use_cpu=False kept"):
        args = wd.training_arguments(str(tmp_path), use_cpu=False, report_to=[])
    assert str(args.device) == "cpu"
    with pytest.raises(wd.ConfigConflictError, match="contradicts the device cpu"):
        wd.training_arguments(str(tmp_path), device="cpu", use_cpu=False)


@pytest.mark.usefixtures("restore_accelerate_variables")
@pytest.mark.parametrize("spec", ["cpu,flags=", "cuda:1"])
def test_use_cpu_false_under_accelerate_use_cpu_trains_on_the_cpu_as_plain_training_arguments_does(
    tmp_path, monkeypatch, spec
):
    # TrainingArguments trains on the CPU when use_cpu or ACCELERATE_USE_CPU says so (training_args.py,
    # _setup_devices): use_cpu=False does not contradict the variable, which whichdevice followed.
    from transformers import TrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    plain = TrainingArguments(str(tmp_path), use_cpu=False, report_to=[])
    with simulate(spec), pytest.warns(UserWarning, match="use_cpu=False kept: ACCELERATE_USE_CPU='1' makes"):
        args = wd.training_arguments(str(tmp_path), use_cpu=False, report_to=[])
    assert args.device.type == plain.device.type == "cpu" and args.use_cpu is False


def test_fp16_weights_under_fp16_mixed_precision_are_warned(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiny_models import tiny_config

    fp16_model = AutoModelForCausalLM.from_config(tiny_config()).half()
    fp32_model = AutoModelForCausalLM.from_config(tiny_config())
    with simulate("cuda:1,cc=7.5,mem=16GiB,name=Tesla T4"):  # fp16 mixed precision is the choice here
        with (
            pytest.warns(UserWarning, match="Attempting to unscale FP16 gradients"),
            pytest.raises(SimulatedTrainingError) as err,
        ):
            wd.training_arguments(str(tmp_path), model=fp16_model)
        assert err.value.kwargs["fp16"] is True
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(SimulatedTrainingError):
                wd.training_arguments(str(tmp_path), model=fp32_model)


_ENVIRONMENT_AFTER = """
import json, os, sys, tempfile
import whichdevice as wd
before = dict(os.environ)
wd.training_arguments(output_dir=tempfile.mkdtemp())
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in {*before, *after} if before.get(k) != after.get(k)}))
"""


@pytest.mark.parametrize("preset", [None, "/tmp/my-inductor-cache"], ids=["unset", "set-by-the-user"])
def test_training_arguments_leaves_the_environment_as_it_was(preset: str | None) -> None:
    # A fresh process: the import of TrainingArguments (peft -> bitsandbytes -> torch.compile) is
    # what sets TORCHINDUCTOR_CACHE_DIR, and this one has imported it long ago.
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if preset is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = preset
    done = subprocess.run(
        [sys.executable, "-c", _ENVIRONMENT_AFTER], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(done.stdout.splitlines()[-1]) == {}


# ------------------------------------------------------------------------- one plan, one path (issue 44)


def _llama_8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


def _would_build(**call) -> dict:
    """The keywords training_arguments() would build with under simulate() (SimulatedTrainingError.kwargs)."""
    with pytest.raises(SimulatedTrainingError) as err:
        wd.training_arguments("out", report_to=[], **call)
    return err.value.kwargs


@pytest.mark.parametrize("launch", [None, "ZeRO-3"])
def test_training_arguments_with_model_makes_the_plan_resolve_device_makes(monkeypatch, launch):
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    if launch:
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    config = _llama_8b()
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        direct = _would_build(model=config)
        res = wd.resolve_device(model=config, task="training")
        via = _would_build(resolution=res)
    assert direct == via
    # accelerator_config appears where an earlier Accelerator configured accelerate's state (kept then).
    theirs = {k: v for k, v in direct.items() if k not in ("output_dir", "report_to", "accelerator_config")}
    assert theirs == res.training_kwargs()
    # Under torchrun whichdevice plans the strategy; under the launch's ZeRO-3 it passes none over it.
    assert ("deepspeed" in direct or "fsdp" in direct) == (launch is None)


@pytest.mark.usefixtures("restore_accelerate_variables")
def test_training_arguments_with_a_loaded_model_reads_its_config(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "model", tokenizer=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    by_path = wd.training_arguments(str(tmp_path / "a"), model=str(folder), report_to=[])
    by_model = wd.training_arguments(str(tmp_path / "b"), model=loaded, report_to=[])
    by_res = wd.training_arguments(
        str(tmp_path / "c"), resolution=wd.resolve_device(model=str(folder), task="training"), report_to=[]
    )
    keys = ("use_cpu", "bf16", "fp16", "ddp_backend", "fsdp", "deepspeed")
    assert [{k: getattr(a, k) for k in keys} for a in (by_model, by_res)] == [
        {k: getattr(by_path, k) for k in keys}
    ] * 2
