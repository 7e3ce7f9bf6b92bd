"""A training job's memory (memory/training_job.py) and the way to train it (memory/training_fit.py), held to
the record: the QLoRA paper, and what a single GPU is known to train."""

from __future__ import annotations

import contextlib
import warnings

import pytest

import whichdevice as wd
from whichdevice.core.job import Job
from whichdevice.memory.fit import CUDA_CONTEXT, priced_margin
from whichdevice.memory.training_job import adapter_parameters, setup_weights, training_memory
from whichdevice.memory.training_records import TrainingSetup
from whichdevice.model.facts import estimate_model_size, model_shape
from whichdevice.testing import simulate

GiB = 1024**3


def _llama_3_8b():
    """Llama-3.1-8B's config (meta-llama/Llama-3.1-8B config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                       dtype="bfloat16")  # fmt: skip


def _llama_65b():
    """LLaMA-65B's config (huggyllama/llama-65b config.json), the QLoRA paper's headline model."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=8192, intermediate_size=22016, num_hidden_layers=80, num_attention_heads=64,
                       vocab_size=32000, max_position_embeddings=2048, dtype="float16")  # fmt: skip


# ---------------------------------------------------------------------------------------- the record


@pytest.mark.parametrize("tokens", [512, 2048])
def test_an_8b_trains_on_one_24gib_gpu_with_bf16_compute(tokens):
    """8B QLoRA is routinely trained on a single 24 GB GPU (torchtune's table: Llama 3.1 8B QLoRA on one
    RTX 4090); asked for 4-bit it fits as QLoRA computing in bf16, and left to decide it fits unquantized
    as LoRA on the bf16 weights (torchtune: 8B LoRA on one 4090 too)."""
    with simulate("cuda:1,mem=24GiB,cc=8.9,name=NVIDIA GeForce RTX 4090"):
        qlora = wd.resolve_device(
            model=_llama_3_8b(), task="training", batch_size=1, max_length=tokens, quantize="4bit"
        )
        auto = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=tokens)
    assert qlora.training_setup.train == "qlora" and qlora.quantization.compute_dtype == "bfloat16"
    assert qlora.model_kwargs()["quantization_config"].bnb_4bit_use_double_quant is True
    assert qlora.training_kwargs()["bf16"] is True
    assert auto.training_setup.train == "lora" and auto.dtype_name == "bfloat16" and auto.quantization is None


def test_an_8b_qlora_on_an_h100_computes_in_bf16_not_float32():
    with simulate("cuda:1,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=2048, quantize="4bit")
    assert res.quantization.compute_dtype == "bfloat16" and "computing in bfloat16" in res.quantization.explanation
    memory = next(s.message for s in res.trace if s.topic == "memory" and s.message.startswith("QLoRA"))
    assert "activations" in memory


def test_the_65b_fits_one_48gb_gpu_as_the_qlora_paper_ran_it():
    """Dettmers et al. 2023 (arXiv:2305.14314): LLaMA-65B fine-tuned on one 48 GB GPU. As its released
    script runs it (artidoro/qlora scripts/finetune_guanaco_65b.sh, qlora.py's defaults): NF4 with double
    quantization, bf16 compute, LoRA r=64 on every linear layer, gradient checkpointing, the paged 32-bit
    AdamW, batch 1 of 16 + 512 tokens. Priced with lora_training's float32 adapters (the paper's script
    casts them to bf16, which needs less)."""
    config = _llama_65b()
    size, shape = estimate_model_size(config), model_shape(config)
    paper = TrainingSetup("qlora", "bfloat16", "bfloat16", True, "paged_adamw_32bit", lora_r=64)
    memory = training_memory(size, shape, Job("training", 1, 16 + 512), paper)
    weights = setup_weights(size, paper)
    card = 48 * GiB
    usable = priced_margin("cuda", None, "training").usable(card, memory.bytes)
    assert weights + memory.bytes <= usable, (weights + memory.bytes) / GiB
    # the 4-bit base alone is about 33 GiB (NF4 + double quantization, embeddings and head in float32)
    assert 31 * GiB < weights < 35 * GiB
    # and whichdevice's own answer for the same job on that card is QLoRA with bf16 compute
    with simulate("cuda:1,mem=48GiB,cc=8.6,name=NVIDIA RTX A6000"):
        res = wd.resolve_device(model=config, task="training", batch_size=1, max_length=528)
    assert res.training_setup.train == "qlora" and res.quantization.compute_dtype == "bfloat16"
    assert res.gradient_checkpointing is True
    assert "activation_checkpointing" in res.training_kwargs()


def test_an_8b_full_fine_tune_on_eight_80gib_gpus_keeps_zero_or_fsdp(monkeypatch):
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=2048)
    assert res.training_plan.chosen.key in ("zero2", "fsdp", "zero3")
    assert res.training_setup.train == "full"


# ------------------------------------------------------------------------------------- the terms


def test_optimizer_state_per_trained_parameter():
    config = _llama_3_8b()
    size, shape = estimate_model_size(config), model_shape(config)
    job = Job("training")
    states = {
        name: training_memory(size, shape, job, TrainingSetup("full", optimizer=name)).term("optimizer state")
        for name in ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
    }
    p = size.parameters
    assert states == {"adamw": 8 * p, "adamw_8bit": 2 * p, "paged_adamw_8bit": 2 * p, "paged_adamw_32bit": 8 * p}


def test_paged_optimizer_state_is_not_counted_through_backward():
    config = _llama_3_8b()
    size, shape = estimate_model_size(config), model_shape(config)
    job = Job("training", 1, 512)
    plain = training_memory(size, shape, job, TrainingSetup("qlora", "bfloat16", "bfloat16", True, "adamw_8bit"))
    paged = training_memory(size, shape, job, TrainingSetup("qlora", "bfloat16", "bfloat16", True, "paged_adamw_8bit"))
    assert paged.bytes < plain.bytes and plain.bytes - paged.bytes <= plain.term("optimizer state")


def test_lora_adapters_are_what_lora_training_makes(tmp_path):
    """rank x (rows + columns) of every linear layer but the head: counted from the checkpoint, and equal
    to what peft really adds through lora_training."""
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    size = estimate_model_size(str(folder))
    model = AutoModelForCausalLM.from_pretrained(folder)
    res = wd.resolve_device("cpu", task="training")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = wd.lora_training(model, res)
    assert adapter_parameters(size, 16)[0] == lora.trainable_parameters
    assert "rank 16 on every linear layer but the head" in adapter_parameters(size, 16)[1]


def test_the_cuda_margin_is_priced_and_other_devices_keep_a_share():
    cuda = priced_margin("cuda", None, "training")
    assert cuda.usable(80 * GiB, 10 * GiB) == 80 * GiB - CUDA_CONTEXT - GiB
    assert "CUDA context" in cuda.said and "fragmentation" in cuda.said
    assert "HIP context" in priced_margin("cuda", "rocm", "training").said
    for backend in ("hpu", "xpu", "npu", "tpu", "neuron", "mps", "cpu"):
        assert priced_margin(backend, None, "training").usable(100, 0) == 80
    assert priced_margin("cuda", None, "inference").usable(100, 0) == 80


# ------------------------------------------------------------------------------ the QLoRA compute dtype


@pytest.mark.parametrize(
    ("spec", "compute"),
    [
        ("cuda:1,mem=16GiB,cc=7.5,name=Tesla T4", "float16"),
        ("cuda:1,mem=16GiB,cc=7.0,name=Tesla V100-SXM2-16GB", "float16"),
        ("cuda:1,mem=24GiB,cc=8.6", "bfloat16"),
        ("cuda:1,mem=80GiB,cc=9.0", "bfloat16"),
        ("cuda:1,variant=rocm,mem=64GiB,name=AMD Instinct MI250X", "bfloat16"),
        ("hpu:1,gen=gaudi2", "bfloat16"),
    ],
)
def test_qlora_computes_in_the_devices_fast_half_precision(spec, compute):
    with simulate(spec):
        res = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=512, quantize="4bit")
    assert res.quantization.compute_dtype == compute


# ------------------------------------------------------------------------------- gradient checkpointing


def test_checkpointing_is_turned_on_only_where_the_job_needs_it_and_handed_over():
    with simulate("cuda:1,mem=24GiB,cc=8.9"):
        short = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=128)
        long = wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=2048)
    assert long.gradient_checkpointing is True
    assert long.training_kwargs()["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    said = [s.message for s in long.trace if s.topic == "training"]
    assert any("one more forward pass per step" in m for m in said)
    assert any("does not fit" in s.message for s in long.trace if s.topic == "memory")
    assert short.gradient_checkpointing in (True, False)  # decided, with the job's sequences known
    if not short.gradient_checkpointing:
        assert "activation_checkpointing" not in short.training_kwargs()


def test_checkpointing_pinned_off_is_priced_off():
    """Without checkpointing an 8B keeps about 30 GiB of activations at 2048 tokens (every layer's, in the
    float32 residual stream peft's k-bit preparation leaves): nothing fits 24 GiB, and the error says so."""
    pinned = dict(model=_llama_3_8b(), task="training", batch_size=1, gradient_checkpointing=False)
    with simulate("cuda:1,mem=24GiB,cc=8.9"):
        res = wd.resolve_device(max_length=256, **pinned)
        with pytest.raises(wd.DoesNotFitError) as err:
            wd.resolve_device(max_length=2048, **pinned)
    assert res.gradient_checkpointing is False and "activation_checkpointing" not in res.training_kwargs()
    assert "gradient_checkpointing=True" in str(err.value) and "activations" in str(err.value)


def test_checkpointing_is_not_decided_without_the_jobs_sequences():
    with simulate("cuda:1,mem=24GiB,cc=8.9"):
        res = wd.resolve_device(model=_llama_3_8b(), task="training")
    assert res.gradient_checkpointing is None and "activation_checkpointing" not in res.training_kwargs()


@pytest.mark.parametrize("value", ["yes", 1, "False", 0.0])
def test_checkpointing_takes_true_false_or_none(value):
    with pytest.raises(wd.DeviceError, match=r"gradient_checkpointing=.*pass True, False, or None"):
        wd.resolve_device(task="training", gradient_checkpointing=value)


def _class_without_checkpointing():
    """A causal-LM class of the installed transformers with supports_gradient_checkpointing=False (CTRL, XLNet,
    OpenAI GPT, ... in transformers 5), and a config of its model type; asked of transformers, not typed."""
    import transformers
    from transformers.models.auto import modeling_auto

    for model_type, name in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = getattr(transformers, name if isinstance(name, str) else name[0], None)
        if cls is not None and not getattr(cls, "supports_gradient_checkpointing", False) and model_type == "ctrl":
            return transformers.AutoConfig.for_model(model_type, n_embd=256, n_layer=4, n_head=4, vocab_size=1000)
    pytest.skip("every causal-LM class of this transformers can checkpoint")


def test_a_class_that_cannot_checkpoint_is_priced_without_it():
    config = _class_without_checkpointing()
    with simulate("cuda:1,mem=24GiB,cc=8.9"):
        res = wd.resolve_device(model=config, task="training", batch_size=1, max_length=512)
        with pytest.raises(wd.ConfigConflictError, match="supports_gradient_checkpointing=False"):
            wd.resolve_device(model=config, task="training", max_length=512, gradient_checkpointing=True)
    assert "gradient checkpointing not priced: CTRLLMHeadModel" in res.explain()
    assert res.gradient_checkpointing is False


# --------------------------------------------------------------------------------- ways out that run


@pytest.mark.parametrize(
    "spec", ["neuron:1,mem=16GiB", "tpu:1,mem=16GiB", "hpu:1,gen=gaudi1,mem=16GiB", "mlu:1,mem=16GiB"]
)
def test_no_bitsandbytes_advice_where_bitsandbytes_does_not_run(spec):
    with simulate(spec), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama_3_8b(), task="training", batch_size=1, max_length=4096)
    message = str(err.value)
    assert "quantize='auto'" not in message and "adamw_bnb_8bit" not in message and "QLoRA" not in message


# ------------------------------------------------------------------------------ one plan, every path


def test_training_arguments_for_a_model_that_does_not_fit_in_full_says_what_does():
    # A simulated CPU builds no arguments (SimulatedTrainingError): the warning comes before it.
    simulated = simulate("cpu,mem=23GiB,flags=avx512_bf16")
    with simulated, pytest.warns(UserWarning) as caught, contextlib.suppress(wd.DeviceError):
        wd.training_arguments("out", model=_llama_3_8b())
    said = " ".join(str(w.message) for w in caught)
    assert "full fine-tuning" in said and "GiB" in said and "lora_training" in said


def _one(spec: str) -> str:
    head, comma, rest = spec.partition(",")
    return f"{head.split(':')[0]}:1{comma}{rest}"


def test_every_path_prices_the_same_job_the_same_way_on_every_default_machine():
    """plan_hardware's one-device rows, resolve_device and training_arguments(model=) on each default
    machine: the same way to train, dtype and keywords (issue 53: "one plan through every path")."""
    from whichdevice.report.plan import DEFAULT_MACHINES, plan_hardware
    from whichdevice.training.simulated import SimulatedTrainingError

    config = _llama_3_8b()
    machines = [(name, spec) for name, spec in DEFAULT_MACHINES if spec]
    plan = plan_hardware(config, task="training", batch_size=1, max_length=2048, machines=machines)
    for name, spec in machines:
        row = next(r for r in plan.rows if r.machine == name and r.spec in (_one(spec), spec))
        with simulate(row.spec):
            try:
                res = wd.resolve_device(model=config, task="training", batch_size=1, max_length=2048)
            except wd.DoesNotFitError as err:
                assert not row.fits and row.note and row.note in str(err), name
                continue
            assert row.fits and row.dtype == res.dtype_name, name
            assert row.strategy == res.training_setup.describe() or res.training_plan is not None, name
            kwargs = {k: v for k, v in res.training_kwargs().items() if k not in ("bf16", "fp16")}
            if res.backend.name == "cpu":
                continue
            with pytest.raises(SimulatedTrainingError) as built, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wd.training_arguments("out", model=config)
            # training_arguments(model=) resolves without the job's length: the same way, undecided checkpointing
            assert all(built.value.kwargs.get(k) == v for k, v in kwargs.items() if "checkpointing" not in k), name


def test_lora_training_takes_what_the_plan_priced(tmp_path):
    """The rank, targets and checkpointing lora_training applies by default are the ones the resolution
    priced; a different rank is said with what it costs. A 17M-parameter Llama whose full fine-tune (about
    270 MB) does not fit 150 MiB, and whose LoRA on the bf16 weights does."""
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "small", tokenizer=False, hidden_size=512, intermediate_size=1376,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
    res = wd.resolve_device("cpu", model=str(folder), task="training", max_memory={"cpu": "150MiB"}, dtype="bfloat16")
    assert res.training_setup is not None and res.training_setup.train == "lora"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = wd.lora_training(AutoModelForCausalLM.from_pretrained(folder, **res.model_kwargs()), res)
        other = wd.lora_training(AutoModelForCausalLM.from_pretrained(folder, **res.model_kwargs()), res, r=64)
    assert same.trainable_parameters == res.training_setup.adapters
    assert res.gradient_checkpointing is None and same.gradient_checkpointing is True  # undecided: peft's default
    assert not any("priced" in n for n in same.notes)
    assert any("the resolution priced" in n and "r=64" in n for n in other.notes)
