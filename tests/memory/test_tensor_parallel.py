"""Tensor parallelism as transformers runs it: the keywords whichdevice hands over load a tiny model
under a 2-process CPU torchrun (gloo) and generate the same tokens as one process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiny_models import save_tiny_llama, tiny_config
from whichdevice.memory.tensor_parallel import tensor_parallel, tp_keywords, tp_plan_of

_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from transformers import AutoModelForCausalLM
    from whichdevice.memory.tensor_parallel import tp_keywords
    extra = tp_keywords() if os.environ.get("WORLD_SIZE") else {}
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, **extra)
    out = model.generate(torch.tensor([[1, 5, 9, 13]]), max_new_tokens=8, do_sample=False)
    kind = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    rank = os.environ.get("RANK", "-")
    # One file a process: two ranks printing to one pipe at once ran their lines together.
    with open(os.path.join(sys.argv[2], f"tokens-{rank}.txt"), "w") as f:
        f.write(f"TOKENS {rank} {out.tolist()} {kind}")
    """
)


def _tokens(folder: Path) -> list[str]:
    return [p.read_text() for p in sorted(folder.glob("tokens-*.txt"))]


def test_tp_keywords_load_sharded_under_torchrun_and_generate_the_same_tokens(tmp_path: Path) -> None:
    folder = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    script = tmp_path / "tp.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    single_out, ranks_out = tmp_path / "one", tmp_path / "two"
    single_out.mkdir()
    ranks_out.mkdir()
    one = subprocess.run(
        [sys.executable, str(script), str(folder), str(single_out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    two = subprocess.run(
        [*torchrun, str(script), str(folder), str(ranks_out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert two.returncode == 0, two.stderr[-3000:]
    (single,) = _tokens(single_out)
    ranks = _tokens(ranks_out)
    assert len(ranks) == 2
    expected = single.split(" ", 2)[2].rsplit(" ", 1)[0]
    for line in ranks:
        assert line.split(" ", 2)[2].rsplit(" ", 1) == [expected, "DTensor"]  # sharded, same tokens


def test_tp_needs_a_plan_on_the_config_class_and_heads_that_divide() -> None:
    config = tiny_config().to_dict()
    plan, source = tp_plan_of(config)
    assert plan and source == "LlamaConfig.base_model_tp_plan"
    assert tensor_parallel(config, 2, 1000, 100, 10, 10_000).fits
    uneven = tensor_parallel(config, 3, 1000, 100, 10, 10_000)
    assert not uneven.fits and "4 attention heads do not divide by 3" in uneven.unavailable
    gpt2 = tensor_parallel({"model_type": "gpt2", "n_head": 12}, 2, 1000, 0, 0, 10_000)
    assert not gpt2.fits and "declares no base_model_tp_plan" in gpt2.unavailable
    assert tensor_parallel(config, 2, 1000, 100, 10, 500).per_device == 560
    custom = tensor_parallel({**config, "auto_map": {"AutoModel": "x.Y"}}, 2, 1, 1, 1, 10)
    assert "its own code" in custom.unavailable


@pytest.mark.parametrize("key", ["distributed_config", "tp_plan"])
def test_the_keywords_are_the_ones_from_pretrained_takes(key: str) -> None:
    import inspect

    from transformers import PreTrainedModel

    kwargs = tp_keywords()
    if key not in kwargs:
        pytest.skip(f"{key} is not what the installed transformers takes")
    source = inspect.getsource(PreTrainedModel.from_pretrained)
    assert f'"{key}"' in source or f"{key}=" in source or f"'{key}'" in source
