#!/usr/bin/env bash
# The GPU part of issue 27 as one call on a machine with a CUDA GPU, run from the repository root:
#   1. whichdevice's own report, check and smoke test there (the real probe, a real driver);
#   2. generation_cache.py handover: whole jobs, compile included, with the generate keywords whichdevice hands
#      over and with the other answer, for HANDOVER_SIZES (default 0.1B) within HANDOVER_S seconds
#      (default 200; a run cut off records how long it ran);
#   3. generation_cache.py long: generate's own cache over 4700 new tokens (0.4B shape), within LONG_S (default 60);
#   4. generation_cache.py compile (dynamic cache, static cache, static cache compiled by generate) per size,
#      the 1.1B first, each size only while BUDGET_S seconds (default 420, counted from the start)
#      are not spent.
# Output goes to $OUT (default benchmarks/results/gpu): gpu.txt, report.txt, smoke.txt,
# gpu_handover.txt/.json, long_decode.txt and compile_decode.txt (its JSON lines; at most 8 files come back
# from a device run).
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
deadline=$((SECONDS + ${BUDGET_S:-420}))

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$py" -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "accelerate", accelerate.__version__)'
    nproc
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

timeout 90 "$py" -m whichdevice > "$out/report.txt" 2>&1
echo "report rc=$?" | tee -a "$out/gpu.txt"
timeout 60 "$py" -m whichdevice check >> "$out/report.txt" 2>&1
echo "check rc=$?" | tee -a "$out/gpu.txt"
timeout 120 "$py" -m whichdevice smoke > "$out/smoke.txt" 2>&1
echo "smoke rc=$?" | tee -a "$out/gpu.txt"

# shellcheck disable=SC2086  # HANDOVER_SIZES is a list of words
timeout $((${HANDOVER_S:-200} + 30)) "$py" benchmarks/generation_cache.py handover --sizes ${HANDOVER_SIZES:-0.1B} \
    --budget-s "${HANDOVER_S:-200}" --json "$out/gpu_handover.json" > "$out/gpu_handover.txt" 2>&1
echo "handover rc=$? at ${SECONDS}s" | tee -a "$out/gpu.txt"
grep -h '^{' "$out/gpu_handover.txt"

# generate's own cache over a long job, per 500 steps as it goes (0.4B shape): a run cut off at LONG_S
# (default 60 s) keeps the curve so far; the 4700-token job ran under 16 tokens/s on the last H200.
timeout "${LONG_S:-60}" "$py" benchmarks/generation_cache.py long --device cuda --layers 20 --hidden 1024 \
    --intermediate 2816 --heads 16 --kv-heads 4 --new 4700 > "$out/long_decode.txt" 2>&1
echo "long_decode rc=$? at ${SECONDS}s" | tee -a "$out/gpu.txt"
cat "$out/long_decode.txt"

for size in 1.1B 0.1B 0.4B; do
    left=$((deadline - SECONDS))
    if [ "$left" -lt 90 ]; then
        echo "skipped $size: ${left}s left" | tee -a "$out/compile_decode.txt"
        continue
    fi
    timeout "$left" "$py" benchmarks/generation_cache.py compile --size "$size" --new "${NEW:-65}" --rounds 3 \
        --json "${TMPDIR:-/tmp}/compile_decode_$size.json" >> "$out/compile_decode.txt" 2>&1
    echo "$size rc=$? at ${SECONDS}s" | tee -a "$out/compile_decode.txt"
done
grep -h '^{' "$out/compile_decode.txt"
