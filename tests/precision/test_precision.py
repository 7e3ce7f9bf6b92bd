"""Training precision that trains: the weights' dtype and the mixed-precision flags agree, every flag is
stated, a checkpoint's own dtype is read, and architectures that overflow in fp16 never run in it."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.model.facts import checkpoint_dtype
from whichdevice.precision.decide import EXPLICIT_TRAINING_DTYPE
from whichdevice.precision.fp16_safe import KNOWN_OVERFLOW
from whichdevice.precision.training import check_precision_flag, precision_conflicts
from whichdevice.testing import simulate

T4 = "cuda:1,cc=7.5,mem=16GiB,name=Tesla T4"
H100 = "cuda:1,cc=9.0,mem=80GiB,name=NVIDIA H100"


# TrainingArguments exports ACCELERATE_* variables by design (see conftest.py)
pytestmark = pytest.mark.usefixtures("restore_accelerate_variables")


def _messages(res: wd.Resolution) -> str:
    return "\n".join(step.message for step in res.trace)


def _config_only(tmp_path, name, **config):
    """A checkpoint folder with just config.json: enough for the dtype and architecture."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _one_scaled_step(model: torch.nn.Module, fp16: bool) -> float:
    """One optimizer step as Trainer takes it under fp16=True: autocast, GradScaler, unscale (for
    gradient clipping), step. On the CPU, since torch's GradScaler accepts the CPU device."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return float(loss.detach())


@pytest.mark.slow
def test_t4_training_resolution_takes_a_gradscaler_step(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    with simulate(T4):
        res = wd.resolve_device(task="training", model=str(path))
    train = res.training_kwargs()
    assert train == {"bf16": False, "fp16": True}
    dtype = {k: v for k, v in res.model_kwargs().items() if k in ("dtype", "torch_dtype")}
    assert list(dtype.values()) == [torch.float32]
    model = AutoModelForCausalLM.from_pretrained(path, **dtype)  # loaded on the CPU: the T4 is simulated
    before = [p.detach().clone() for p in model.parameters()]
    loss = _one_scaled_step(model, fp16=train["fp16"])
    assert torch.isfinite(torch.tensor(loss))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert "GradScaler unscales only fp32 gradients" in _messages(res)


@pytest.mark.slow
def test_fp16_weights_under_fp16_mixed_precision_cannot_step(tmp_path):
    # What resolve_device handed over before: fp16 weights with fp16=True.
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _one_scaled_step(model, fp16=True)


@pytest.mark.parametrize("spec", ["cpu,flags=", "cpu,flags=avx512_bf16", H100, T4, "mps,macos=13.6"])
def test_training_states_both_flags_and_fp32_weights(spec):
    with simulate(spec):
        res = wd.resolve_device(task="training")
    kwargs = res.training_kwargs()
    assert isinstance(kwargs["bf16"], bool) and isinstance(kwargs["fp16"], bool)
    assert not (kwargs["bf16"] and kwargs["fp16"])
    assert res.dtype == torch.float32
    if kwargs["bf16"]:
        assert "float32 weights with bf16 mixed precision" in _messages(res)
        assert "not pure bf16 weights" in _messages(res)


def test_trl_config_gets_whichdevices_precision(tmp_path):
    trl = pytest.importorskip("trl")
    with simulate("cpu,flags="):
        kwargs = wd.resolve_device(task="training").training_kwargs()
    # SFTConfig defaults to bf16=True; the stated bf16=False wins.
    config = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], **kwargs)
    assert config.bf16 is False and config.fp16 is False


def test_a_p100_gets_fp16_from_nvidias_throughput_table():
    with simulate("cuda:1,cc=6.0,mem=16GiB,name=Tesla P100"):
        res = wd.resolve_device(task="training")
        inference = wd.resolve_device()
    assert res.training_kwargs() == {"bf16": False, "fp16": True}
    assert inference.dtype == torch.float16
    assert "fp16 arithmetic runs at 2x fp32 on compute capability 6.0" in _messages(inference)
    assert check_precision_flag(res.target, "fp16").verdict == "ok"


def test_user_bf16_on_a_cpu_without_native_bf16_warns_with_the_measured_cost():
    from whichdevice.measure.calibration import calibration

    with simulate("cpu,flags=,calib=bf16.prompt:0.0306/fp16.prompt:0.25"):
        res = wd.resolve_device(task="training")
        calib = calibration(measure=False)[0]
    check = check_precision_flag(res.target, "bf16", calib)
    assert check.verdict == "warn"
    # This CPU's figure, saying where it comes from; none typed from another machine.
    assert "measured on this CPU (whichdevice's calibration): a prompt-sized bf16 matmul runs at 0.03x" in check.message
    assert "0.30x" not in check.message and "0.63x" not in check.message
    assert precision_conflicts(res.target, {"bf16": True}, calib) == [check.message]
    fp16 = check_precision_flag(res.target, "fp16", calib)
    assert "fp16 matmul runs at 0.25x the speed of fp32 (4.0x the time)" in fp16.message
    assert "measured here" not in fp16.message
    uncalibrated = check_precision_flag(res.target, "fp16")
    assert "its cost is not measured on this CPU" in uncalibrated.message


def test_precision_flags_that_cannot_run_are_refused():
    with simulate("mps,macos=13.6"):
        mps = wd.resolve_device(task="training")
    with pytest.raises(wd.ConfigConflictError, match="macOS 14"):
        precision_conflicts(mps.target, {"bf16": True})
    with simulate("tpu:4"):
        tpu = wd.resolve_device(task="training")
    check = check_precision_flag(tpu.target, "fp16")
    assert check.verdict == "refuse" and "bf16=True" in check.message
    with simulate("cpu,flags=avx512_bf16"):
        cpu = wd.resolve_device(task="training")
    assert check_precision_flag(cpu.target, "bf16").verdict == "ok"


@pytest.mark.parametrize(
    ("stored", "expected"), [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16")]
)
def test_inference_keeps_a_supported_half_checkpoint_and_downcasts_fp32(tmp_path, stored, expected):
    path = _config_only(tmp_path, "llama", model_type="llama", dtype=stored)
    with simulate(H100):
        res = wd.resolve_device(model=path, max_memory={0: "10GiB"}, device_map="cuda:0")
    assert res.dtype_name == expected
    assert f"config.json's dtype '{stored}'" in _messages(res)


def test_checkpoint_dtype_from_safetensors_headers(tmp_path):
    path = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    read = checkpoint_dtype(str(path))
    assert read is not None and read.dtype == "bfloat16" and read.model_type == "llama"
    assert "safetensors headers" in read.source


def test_bf16_checkpoint_of_an_allow_listed_architecture_on_a_t4_is_cast_to_fp16(tmp_path):
    path = _config_only(tmp_path, "llama", model_type="llama", dtype="bfloat16")
    with simulate(T4):
        res = wd.resolve_device(model=path, device_map="cuda:0")
    assert res.dtype_name == "float16"
    assert "'llama' is known to run in fp16 (Meta published Llama 2 in fp16" in _messages(res)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "t5"])
def test_fp16_unsafe_architectures_never_compute_in_fp16(tmp_path, model_type):
    path = _config_only(tmp_path, model_type, model_type=model_type, dtype="bfloat16")
    with simulate(T4):
        inference = wd.resolve_device(model=path, device_map="cuda:0")
        training = wd.resolve_device(model=path, device_map="cuda:0", task="training")
    assert inference.dtype_name == "float32"
    assert f"{model_type!r} is known to overflow in fp16" in _messages(inference)
    assert training.dtype_name == "float32"
    assert training.training_kwargs() == {"bf16": False, "fp16": False}
    with simulate("mps,macos=14.5"):
        # Apple's GPUs prefer fp16, but these architectures get bf16 where the OS has it.
        assert wd.resolve_device(model=path).dtype_name == "bfloat16"


def test_every_fp16_overflowing_architecture_names_its_source():
    from transformers import CONFIG_MAPPING

    for model_type, source in KNOWN_OVERFLOW.items():
        assert "#" in source or "vllm/config/model.py" in source, model_type
    # plamo2 is remote code; every other entry is an architecture the installed transformers knows.
    assert set(KNOWN_OVERFLOW) - set(CONFIG_MAPPING) <= {"plamo2"}


def test_explicit_fp16_weights_for_training_turn_fp16_mixed_precision_off():
    with simulate(T4):
        res = wd.resolve_device(task="training", dtype="float16")
    assert res.dtype == torch.float16
    assert res.training_kwargs() == {"bf16": False, "fp16": False}
    assert "Attempting to unscale FP16 gradients" in _messages(res)


def test_explicit_bf16_weights_for_training_are_pure_bf16_and_said_so():
    with simulate(H100):
        res = wd.resolve_device(task="training", dtype="bfloat16")
    assert res.dtype == torch.bfloat16
    assert res.training_kwargs() == {"bf16": True, "fp16": False}
    assert "pure bf16 weights and bf16 compute" in _messages(res)


@pytest.mark.parametrize("spec", [H100, T4, None])
def test_explicit_float32_for_training_means_no_autocast(spec):
    # One rule for an explicit dtype in training: the weights' dtype and the compute dtype.
    with simulate(spec) if spec else contextlib.nullcontext():  # None: this machine
        res = wd.resolve_device(task="training", dtype="float32")
    assert res.dtype == torch.float32
    kwargs = res.training_kwargs()
    assert kwargs["bf16"] is False and kwargs["fp16"] is False
    assert "float32 weights and float32 compute" in _messages(res) and EXPLICIT_TRAINING_DTYPE in _messages(res)


def test_weights_left_to_transformers_never_get_fp16_mixed_precision_blind(tmp_path):
    with simulate(T4):
        unknown = wd.resolve_device(task="training", dtype=None)
        fp32 = wd.resolve_device(
            task="training", dtype=None, model=_config_only(tmp_path, "m", model_type="llama", dtype="float32")
        )
    assert unknown.training_kwargs() == {"bf16": False, "fp16": False}
    assert fp32.training_kwargs() == {"bf16": False, "fp16": True}


@pytest.mark.parametrize(
    ("spec", "dtype", "mixed", "says"),
    [
        ("cuda:1,cc=5.2", torch.float32, None, "no fp16 arithmetic"),
        ("cuda:1,cc=6.1,name=Tesla P40", torch.float32, None, "1/64 of fp32"),
        ("cuda:1,cc=6.0", torch.float16, "fp16", "2x fp32"),
        ("cuda:1,variant=rocm,name=AMD Instinct MI100", torch.float16, "fp16", "184.6"),
        ("cuda:1,variant=rocm,cc=10.3", torch.float16, "fp16", "no bf16 arithmetic"),
        ("cuda:1,variant=rocm,name=AMD Instinct MI250X", torch.bfloat16, "bf16", "support bf16"),
    ],
)
def test_each_gpu_generation_gets_its_fast_dtype_from_the_vendors_figures(spec, dtype, mixed, says):
    with simulate(spec):
        inference = wd.resolve_device()
        training = wd.resolve_device(task="training")
    assert inference.dtype == dtype
    kwargs = training.training_kwargs()
    assert (kwargs["bf16"], kwargs["fp16"]) == (mixed == "bf16", mixed == "fp16")
    assert says in _messages(training) + _messages(inference)


def test_fp16_true_before_fp16_arithmetic_runs_with_a_warning_not_a_refusal():
    with simulate("cuda:1,cc=5.2"):
        res = wd.resolve_device(task="training")
    check = check_precision_flag(res.target, "fp16")
    assert check.verdict == "warn" and "runs, slowly" in check.message and "no fp16 arithmetic" in check.message
    with simulate("cuda:1,cc=6.1"):
        res = wd.resolve_device(task="training")
    assert "1/64 of fp32" in check_precision_flag(res.target, "fp16").message


# ---------------------------------------------------------------- reasons that are true (issue 44)


def test_a_gpu_with_native_bf16_is_said_to_have_it():
    with simulate(H100):
        res = wd.resolve_device(task="training")
    line = next(s.message for s in res.trace if s.topic == "dtype")
    assert "this GPU has compute capability 9.0; bf16 runs natively from 8.0 (Ampere)" in line
    assert "needs compute capability" not in line


def test_the_mi100_runs_bf16_natively_at_half_the_fp16_rate_not_emulated():
    with simulate("cuda:1,variant=rocm,name=AMD Instinct MI100"):
        res = wd.resolve_device(task="training")
    check = check_precision_flag(res.target, "bf16")
    assert check.verdict == "warn" and "emulated" not in check.message
    assert "computes bf16 natively, at half its fp16 rate" in check.message and "184.6" in check.message


@pytest.mark.parametrize("cc", ["5.0", "5.2", "6.1"])
def test_bf16_on_a_gpu_with_slow_fp16_does_not_recommend_fp16(cc):
    with simulate(f"cuda:1,cc={cc}"):
        res = wd.resolve_device(task="training")
    bf16 = check_precision_flag(res.target, "bf16")
    fp16 = check_precision_flag(res.target, "fp16")
    assert fp16.verdict == "warn" and "fp16=True is the fast one" not in bf16.message
    assert "fp32 (neither flag) is the fast one" in bf16.message


# The hardware whose flags the check below walks: every NVIDIA generation in the throughput table and
# around it, AMD's, the other rows, CPUs with and without native bf16.
_ANSWERS = [
    *(f"cuda:1,cc={cc}" for cc in ("3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.5", "8.0", "9.0")),
    "cuda:1,variant=rocm,name=AMD Instinct MI100",
    "cuda:1,variant=rocm,cc=10.3",
    "cuda:1,variant=rocm,name=AMD Instinct MI250X",
    "xpu:1",
    "xpu:1,bf16=no",
    "hpu:1,gen=gaudi1",
    "hpu:1,gen=gaudi2",
    "npu:1",
    "mps,macos=13.6",
    "mps,macos=14.4",
    "tpu:1",
    "neuron:1",
    "cpu,flags=",
    "cpu,flags=avx512_bf16",
]


def _recommended(message: str) -> set[str]:
    """The flags a message recommends: "fp16=True is the fast one", "pass fp16=True"."""
    return {flag for flag in ("bf16", "fp16") if re.search(rf"(pass {flag}=True|{flag}=True is the fast one)", message)}


@pytest.mark.parametrize("spec", _ANSWERS)
def test_no_answer_both_recommends_and_warns_against_one_flag(spec):
    with simulate(spec):
        res = wd.resolve_device(task="training")
        checks = {flag: check_precision_flag(res.target, flag) for flag in ("bf16", "fp16")}
    lines = [s.message for s in res.trace] + [c.message for c in checks.values()]
    for line in lines:
        for flag in _recommended(line):
            assert checks[flag].verdict == "ok", f"{spec}: {line!r} recommends {flag}=True, which warns: {checks}"
        # Within one line: never "fp16=True runs slowly" beside "fp16=True is the fast one".
        for flag in ("bf16", "fp16"):
            against = re.search(rf"{flag}=True (on \S+ )?(runs, slowly|runs emulated|does not work)", line)
            assert not (against and flag in _recommended(line)), line


@pytest.mark.parametrize("value", ["BF16", " bf16 ", "Fp16"])
def test_a_mixed_precision_variable_accelerate_refuses_is_refused_not_followed(monkeypatch, tmp_path, value):
    from accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
    with pytest.raises(ValueError, match="Unknown mixed_precision mode"):  # what accelerate does with it
        Accelerator(mixed_precision=value, cpu=True)
    with simulate("cpu,flags=avx512_bf16"):
        res = wd.resolve_device(task="training")
        with pytest.raises(wd.ConfigConflictError, match="Unknown mixed_precision mode"):
            wd.training_arguments(str(tmp_path), report_to=[])
    assert res.accelerate is not None and res.accelerate.precision is None
    assert any("spelled exactly so" in s.message for s in res.trace if s.topic == "warning")


def test_pure_fp16_training_is_warned_with_the_figures_torch_states():
    with simulate(H100):
        res = wd.resolve_device(task="training", dtype="float16")
    assert res.dtype_name == "float16" and res.training_kwargs()["fp16"] is False
    warning = next(s.message for s in res.trace if s.topic == "warning" and "pure fp16" in s.message)
    eps = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["eps"]
    info = torch.finfo(torch.float16)
    subnormal = info.smallest_normal * info.eps
    assert f"AdamW's eps {eps:g} is below fp16's smallest subnormal {subnormal:.3g}" in warning
    # The figure is what happens: eps added to an fp16 zero stays zero.
    assert (torch.zeros(1, dtype=torch.float16) + eps).item() == 0.0


def test_the_cuda_pages_dtype_table_is_what_the_code_gives():
    """docs/backends/cuda.md's table of compute capabilities, row by row, against resolve_device (issue 58: the
    page gave a GTX 10xx, compute capability 6.1, float16; the code gives float32 at fp16's 1/64 rate)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "backends" / "cuda.md").read_text(encoding="utf-8")
    table = page.split("| compute capability | dtype | examples |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| `(\w+)` \|", table, flags=re.MULTILINE)
    # The words a row may use for a range, and the capabilities checked for each.
    named = {
        "8.0 or newer": ["8.0", "9.0"],
        "7.x": ["7.0", "7.5"],
        "5.3 to 6.x": ["5.3", "6.0", "6.1", "6.2"],
        "below 5.3": ["5.0", "5.2", "3.7"],
    }
    checked = set()
    for capabilities, dtype in rows:
        if capabilities.startswith("unknown"):
            continue
        listed = named.get(capabilities) or [c.strip() for c in capabilities.split(",")]
        assert all(re.fullmatch(r"\d+\.\d+", cc) for cc in listed), f"a row this test cannot read: {capabilities}"
        for cc in listed:
            with simulate(f"cuda:1,cc={cc}"):
                assert wd.resolve_device().dtype_name == dtype, (cc, dtype)
            checked.add(cc)
    assert {"6.1", "6.0", "5.3", "6.2", "7.5", "8.0", "5.2"} <= checked
    with simulate("cuda:1,cc=6.1"):
        assert "fp16 arithmetic runs at 1/64 of fp32" in _messages(wd.resolve_device())
