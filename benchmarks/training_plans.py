"""Which training strategy does whichdevice hand over for a big job, under each launch, and does its estimate hold?

    python benchmarks/training_plans.py                       # every part: about 2-3 minutes on 2 cores
    python benchmarks/training_plans.py --only strategies     # strategies, largest, launches, ranks (repeatable)
    python benchmarks/training_plans.py --only launches --model MODEL_FOLDER

``strategies`` (no timing): a 7B and a 13B Llama full fine-tune (``task="training", quantize=None``, no
batch or length, so activations are not counted, as the trace says) on 1, 2, 4 and 8 simulated 24 GiB
and 80 GiB GPUs, in one process and as rank 0 of a torchrun launch (its variables set in-process): the
strategy chosen, its per-device estimate, the TrainingArguments keywords and the launch command. With
deepspeed installed ZeRO-2 comes before FSDP where it fits. The CPU memory FSDP offload would use is
this machine's (probed for real).

``largest`` (no timing): the longest max_length at batch 1 and 8, and the largest batch at 2048 tokens,
for a 1.1B and a 7B Llama on one 24 GiB GPU (inference, bf16).

``launches`` (no timing; needs deepspeed): an 8B Llama on 8 x 80 GiB
(``simulate("cuda:8,mem=80GiB,cc=9.0")``, rank 0 of 8) under plain torchrun and ``accelerate launch``
with a DDP, FSDP, ZeRO-2 and ZeRO-3 config (the variables accelerate 1.16 exports for each): the
keywords training_kwargs() passes, the strategy that then runs (TrainingArguments built for real with
them under those variables), the per-device estimate, and DeepSpeed's own estimators for the same
parameters. ``--model``: a checkpoint folder instead of the Llama 3 8B config.

``ranks`` (measured, 1-2 minutes): a 50M-parameter Llama trained 3 AdamW steps with DDP and with FSDP2
(torch's ``fully_shard`` on every ``_no_split_modules`` layer, then the root, as accelerate does on an
accelerator) on 2 CPU processes (torchrun, gloo), batch 4 x 128 and 2 x 256 tokens. Each rank warms up
on a miniature, builds and wraps the model, resets its high-water mark (/proc/self/clear_refs) and
trains; measured = its peak RSS above the baseline before the model was built. Against memory/
strategy.py's per-device estimate in fp32; exits 1 where an estimate is below a measured peak or the
ranks end with different weights.

Configs are transformers' LlamaConfig saved to a temporary folder (no weights: sizes come from a meta
build). Prints the machine line, then each part; ``--json PATH`` writes the same.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness

PARTS = ("strategies", "largest", "launches", "ranks")
SHAPES = {
    "1.1B": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632),
    "7B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008),
    "13B": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824),
}  # fmt: skip
CONTEXT = 131072  # long enough that the search is not capped by the model's own context
TORCHRUN = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none")  # fmt: skip


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in this process, and the environment as it was afterwards."""
    before = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def torchrun(world: int) -> dict[str, str]:
    """The variables rank 0 of a single-node torchrun launch of ``world`` processes sees."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    world_size = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    return {k: v for k, v in TORCHRUN.items() if k in names} | world_size


def _config(name: str, folder: str) -> str:
    from transformers import LlamaConfig

    path = os.path.join(folder, name)
    LlamaConfig(**SHAPES[name], vocab_size=32000, max_position_embeddings=CONTEXT).save_pretrained(path)
    return path


def _resolve(path: str, **kw: Any) -> tuple[Any, str | None]:
    import whichdevice as wd

    try:
        return wd.resolve_device(model=path, **kw), None
    except wd.DeviceError as err:
        return None, f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------- strategies, largest


def _row(res: Any, error: str | None) -> str:
    from whichdevice.core.sizes import format_bytes

    if res is None:
        return f"refused: {(error or '')[:200]}..."
    plan = res.training_plan
    chosen = plan.chosen if plan else None
    ranks = f"{plan.devices} ranks: {chosen.name}, {format_bytes(chosen.per_device)}/device; " if chosen else ""
    lora = any(s.topic == "warning" and "LoRA adapters on the" in s.message for s in res.trace)
    here = "QLoRA (4-bit)" if res.quantization is not None else ("LoRA" if lora else "full fine-tune")
    kwargs = {k: v for k, v in res.training_kwargs().items() if k in ("fsdp", "fsdp_config", "deepspeed")}
    launch = " ".join(res.launch_command(["train.py"])) if res.distributed is None else "(launched)"
    return (
        f"{ranks}this process: {here}; device_map={res.device_map!r}, dtype={res.dtype_name}; "
        f"kwargs {kwargs or '{}'}; {launch}"
    )


def strategies(args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    from whichdevice.testing import simulate

    print("## Full fine-tune, quantize=None (activations not counted: no batch_size/max_length)\n")
    found = []
    for name in ("7B", "13B"):
        path = _config(name, folder)
        for mem in ("24GiB", "80GiB"):
            for count in (1, 2, 4, 8):
                for how in ("one process", "torchrun") if count > 1 else ("one process",):
                    launch = torchrun(count) if how == "torchrun" else {}
                    with simulate(f"cuda:{count},mem={mem},name=GPU"), environment(launch):
                        res, err = _resolve(path, task="training", quantize=None)
                    said = _row(res, err)
                    print(f"- {name} on {count} x {mem} ({how}): {said}")
                    found.append({"model": name, "gpus": count, "memory": mem, "how": how, "answer": said})
        print()
    return found


def largest(args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    from whichdevice.testing import simulate

    print("## The largest that fits one 24 GiB GPU (inference, bfloat16)\n")
    found = []
    for name in ("1.1B", "7B"):
        path = _config(name, folder)
        for batch in (1, 8):
            for length in (2048, 4096):
                with simulate("cuda:1,mem=24GiB,name=GPU"):
                    res, err = _resolve(path, batch_size=batch, max_length=length, quantize=None)
                if res is not None:
                    said = res.largest_fit().text()
                else:
                    said = "does not fit; " + (err or "").split("On these devices, ")[-1]
                print(f"- {name}, batch {batch} x {length} tokens: {said}")
                found.append({"model": name, "batch": batch, "max_length": length, "answer": said})
    print()
    return found


# ------------------------------------------------------------------------------------- launches

_ACCELERATE = dict(ACCELERATE_DYNAMO_BACKEND="NO", ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_USE_CPU="False")
LAUNCHES: dict[str, dict[str, str]] = {
    "torchrun": {},
    "accelerate DDP": _ACCELERATE,
    "accelerate FSDP": {**_ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                        "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"},
    "accelerate ZeRO-2": {**_ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    "accelerate ZeRO-3": {**_ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
}  # fmt: skip


def llama_8b(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="bfloat16",
                ).save_pretrained(folder)  # fmt: skip
    return folder


def what_runs(kwargs: dict[str, Any], out: str) -> str:
    """The strategy TrainingArguments (and accelerate's plugin from the variables) holds with ``kwargs``."""
    from transformers import TrainingArguments

    strategy = {k: v for k, v in kwargs.items() if k in ("fsdp", "fsdp_config", "deepspeed")}
    with environment({}):
        for name in TORCHRUN:
            os.environ.pop(name, None)  # one CPU process builds it here
        targs = TrainingArguments(out, use_cpu=True, report_to=[], **strategy)
        if targs.deepspeed_plugin is not None:
            return f"DeepSpeed ZeRO-{targs.deepspeed_plugin.zero_stage}"
        if targs.fsdp_plugin_args is not None:
            return f"FSDP{targs.fsdp_plugin_args.get('fsdp_version', 1)} (from fsdp=)"
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
            return f"FSDP{plugin.fsdp_version} reshard_after_forward={plugin.reshard_after_forward} (the launch's)"
        return "DDP"


def deepspeed_figures(params: int, largest: int, gpus: int) -> tuple[float, float]:
    """Per-GPU GB that deepspeed's _all_cold estimators print (no offload) for ZeRO-2 and ZeRO-3."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    def printed(call: Any, **kw: Any) -> dict[str, float]:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            call(total_params=params, num_gpus_per_node=gpus, num_nodes=1, **kw)
        rows = [line.split("|") for line in buffer.getvalue().splitlines() if line.count("|") == 2][1:]
        return {options.strip(): float(gpu.strip().removesuffix("GB")) for _, gpu, options in rows}

    zero2 = printed(estimate_zero2_model_states_mem_needs_all_cold)["offload_optimizer=none"]
    zero3 = printed(estimate_zero3_model_states_mem_needs_all_cold, largest_layer_params=largest)
    return zero2, zero3["offload_param=none, offload_optimizer=none, zero_init=1"]


def launches(args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    import whichdevice as wd
    from whichdevice.model.facts import estimate_model_size
    from whichdevice.testing import simulate

    model = Path(args.model) if args.model else llama_8b(Path(folder) / "llama-8b")
    size = estimate_model_size(str(model))
    zero2, zero3 = deepspeed_figures(size.parameters, size.largest_module, 8)
    print(f"## {model.name} ({size.parameters / 1e9:.2f}B parameters, largest module {size.largest_module / 1e6:.0f}M)")
    print(f"DeepSpeed's estimators, 8 GPUs on one node, no offload: ZeRO-2 {zero2:.2f} GB, ZeRO-3 {zero3:.2f} GB")
    rows, found = [], []
    for name, variables in LAUNCHES.items():
        with environment({**TORCHRUN, **variables}), simulate("cuda:8,mem=80GiB,cc=9.0"):
            res = wd.resolve_device(model=str(model), task="training", quantize=None)
            kwargs = res.training_kwargs()
            runs = what_runs(kwargs, str(Path(folder) / "out"))
        chosen = res.training_plan.chosen if res.training_plan is not None else None
        passed = {k: v for k, v in kwargs.items() if k in ("fsdp", "deepspeed")}
        said = ", ".join(
            f"{k}=" + (f"{{...stage {v['zero_optimization']['stage']}}}" if k == "deepspeed" else repr(v))
            for k, v in passed.items()
        )
        estimate = f"{chosen.name}: {chosen.per_device / 2**30:.2f} GiB" if chosen else "-"
        figures = {"zero2": f"ZeRO-2 {zero2:.2f} GB", "zero3": f"ZeRO-3 {zero3:.2f} GB"}
        theirs = figures.get(chosen.key if chosen else "", "-")
        rows.append([name, said or "none", runs, estimate, theirs])
        found.append(dict(zip(("launch", "keywords", "runs", "estimate", "deepspeed"), rows[-1], strict=True)))
    head = ["launch", "keywords passed", "strategy that runs", "whichdevice's estimate per device"]
    print("\n" + harness.table([*head, "DeepSpeed's estimator"], rows, markdown=True) + "\n")
    return found


# ------------------------------------------------------------------------------------- ranks

SMALL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip
RANK_CASES = [(4, 128), (2, 256)]


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def rank_child(how: str, out: str, batch: int, length: int) -> None:
    """One rank under torchrun: train with DDP or FSDP2 and write its peak to OUT/rank<N>.json."""
    import torch
    import torch.distributed as dist

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if how == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__ in model._no_split_modules:
                fully_shard(module)
        fully_shard(model)
        return model

    def train(model: torch.nn.Module, batch: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(dist.get_rank())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        for _ in range(3):
            ids = torch.randint(0, vocab, (batch, length), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mini = {**SMALL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
    train(wrap(harness.build_model(**mini)), 1, 8, 64)
    gc.collect()
    start = _status("VmRSS")
    # Built whole on every rank, then wrapped: FSDP frees all but this rank's shard. The training peak is
    # measured from here, as on an accelerator, where the whole model is loaded in CPU memory, not the device's.
    model = wrap(harness.build_model(**SMALL))
    gc.collect()
    held = _status("VmRSS") - start
    base = _status("VmRSS") - held
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    train(model, batch, length, SMALL["vocab_size"])
    peak = _status("VmHWM") - base
    checksum = 0.0
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards are DTensors
        checksum += float(full.detach().double().sum())
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"strategy": how, "rank": rank, "held": held, "peak": peak, "checksum": checksum}, fh)
    dist.destroy_process_group()


def _estimates(batch: int, length: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    from whichdevice.core.job import Job
    from whichdevice.memory.strategy import Priced, plan_strategies
    from whichdevice.memory.training_job import setup_weights, training_memory
    from whichdevice.memory.training_records import TrainingSetup
    from whichdevice.model.facts import estimate_model_size, model_shape
    from whichdevice.model.layers import layer_classes

    config = LlamaConfig(**SMALL)
    size, shape = estimate_model_size(config), model_shape(config)
    job = Job("training", batch, length)
    lora, qlora = TrainingSetup("lora"), TrainingSetup("qlora")
    plan = plan_strategies(
        params=size.parameters, shape=shape, dtype="float32", compute_dtype="float32",
        full=training_memory(size, shape, job, TrainingSetup("full")),
        sharded=training_memory(size, shape, job, TrainingSetup("full", sharded=True)),
        lora=Priced(setup_weights(size, lora), training_memory(size, shape, job, lora)),
        qlora=Priced(setup_weights(size, qlora), training_memory(size, shape, job, qlora)),
        devices=2, budget=1 << 50, cpu_memory=1 << 50, deepspeed=False, layer_classes=layer_classes(config).names,
    )  # fmt: skip
    return {s.key: (s.per_device, s.formula) for s in plan.strategies if s.key in ("ddp", "fsdp")}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks(args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    rows, found = [], []
    mib = 1024**2
    for batch, length in RANK_CASES:
        estimate = _estimates(batch, length)
        for how in ("ddp", "fsdp"):
            with tempfile.TemporaryDirectory() as out:
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node=2",
                    f"--master-port={_port()}",
                ]
                command += [__file__, "--rank", how, out, str(batch), str(length)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ})
                if done.returncode != 0:
                    raise SystemExit(f"{how} failed:\n{done.stderr[-3000:]}")
                measured = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
            equal = len({round(r["checksum"], 6) for r in measured}) == 1
            per_device, formula = estimate[how]
            for r in measured:
                ok = per_device >= r["peak"]
                rows.append(
                    [how, f"{batch} x {length}", int(r["rank"]), f"{r['peak'] / mib:.1f}", f"{r['held'] / mib:.1f}",
                     f"{per_device / mib:.1f}", f"{per_device / r['peak']:.2f}x" + ("" if ok else " BELOW"), equal]
                )  # fmt: skip
                found.append({"strategy": how, "batch": batch, "max_length": length, **r, "estimate": per_device,
                              "formula": formula, "estimate_holds": ok, "ranks_equal": equal})  # fmt: skip
            harness.log(f"  {how} {batch} x {length}: formula {formula}")
    head = ["strategy", "job", "rank", "measured MiB", "weights held MiB", "estimate MiB", "estimate / measured",
            "ranks end equal"]  # fmt: skip
    print("## Measured per-rank peaks, 2 CPU processes (gloo), 3 AdamW steps\n")
    print(harness.table(head, rows, markdown=True))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    ap.add_argument("--model", default=None, help="launches: a checkpoint folder instead of the Llama 3 8B config")
    ap.add_argument("--rank", nargs=4, metavar=("HOW", "OUT", "BATCH", "LENGTH"), help=argparse.SUPPRESS)
    harness.add_json_argument(ap, default=str(harness.RESULTS / "training_plans.json"))
    args = ap.parse_args()
    if args.rank:
        rank_child(args.rank[0], args.rank[1], int(args.rank[2]), int(args.rank[3]))
        return 0
    machine = harness.machine()
    print(harness.machine_line(machine) + "\n")
    runs = {"strategies": strategies, "largest": largest, "launches": launches, "ranks": ranks}
    with tempfile.TemporaryDirectory() as folder:
        found = {part: runs[part](args, folder) for part in PARTS if not args.only or part in args.only}
    harness.write_json(args.json, {"machine": machine, **found})
    bad = [r for r in found.get("ranks", []) if not (r["estimate_holds"] and r["ranks_equal"])]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
