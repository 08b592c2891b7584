#!/usr/bin/env bash
# The GPU checks of a lent GPU session (../shared/docs/gpu-workflow.md), in one script so a device
# call does them together. The first GPU run (one H200, 2026-11-28) used its own scripts
# (bench/results/h200/2026-11-28-first-run/scripts/); what it taught is in here: pytest-xdist's
# --dist load (pyproject's loadfile puts a whole file on one worker), a time limit per step, the GPU
# sweeps sampled one case per key. This script itself has not run on a GPU yet.
#
# Usage, from the repository root on the device machine:
#   bash bench/gpu_session.sh [tests|sanitize|bench|tune|model|all]      (default: all but tune and model)
# Logs and results go to $OUT (the device tool's output folder; /tmp/autoflash-out elsewhere): 8 files
# at most (device.txt, gpu-tests.log, sanitizer.log, bench.log, the bench JSON and its 3 PNGs).
# `tune` is its own call (it needs Optuna: carry .whl from ../shared/scripts/device-wheels.sh and
# install it first, as that script prints): tuned table, its search plot, the recorded timings
# (the simulated backend's fixture) and the log: 4 files.
set -uo pipefail
OUT=${OUT:-/tmp/autoflash-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step=${1:-all}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/device.txt"

if [[ $step == tests || $step == all ]]; then
  # Accuracy tier: correctness only, so several processes may share the GPU (pytest-xdist). Each sweep
  # runs one case per key (825 tests; AUTOFLASH_SWEEP=full for all 9,391). SIGINT at the limit makes
  # pytest print its summary of what ran. pytest-timeout is on the device image.
  timeout -s INT 420 python3 -m pytest -m gpu -q -n 16 --dist load -p no:cacheprovider --timeout 120 -rfE \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -25
  status=$(( status | ${PIPESTATUS[0]} ))
fi

if [[ $step == sanitize || $step == all ]]; then
  # Both kernels at an odd shape (lengths not multiples of any tile, GQA, causal), forward and backward
  # (on an H100 or H200 the plain and causal forward is the sm90 family's: wgmma, TMA, mbarriers).
  # One log for both tools: the device tool brings back at most 8 files.
  # Then the variant kernels (window + softcap + ALiBi over packed sequences, and key padding).
  for tool in memcheck racecheck; do
    for flags in "--causal" "--causal --align bottom_right --window 16,0 --softcap 30 --alibi --varlen" \
                 "--key-padding"; do
      echo "=== compute-sanitizer --tool $tool, selfcheck $flags" >> "$OUT/sanitizer.log"
      # shellcheck disable=SC2086  # $flags is a list of options
      compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 -m autoflash.selfcheck --shape 1,4,2,77,133,96 --dtype bf16 --backward $flags \
        >> "$OUT/sanitizer.log" 2>&1
      rc=$?
      echo "compute-sanitizer $tool ($flags): exit $rc"
      status=$(( status | rc ))
    done
  done
  # The decode kernels (flash_attn_with_kvcache): paged + split + combine with an append and rotary,
  # a dense cache with left padding, a window and softcap, and a key bias (autoflash.hf's decode).
  for tool in memcheck racecheck; do
    for flags in "--causal --new 4 --paged 64 --splits 3 --rotary neox" \
                 "--window 20,0 --softcap 10 --new 2 --leftpad --splits 2" "--causal --key-padding --splits 2"; do
      echo "=== compute-sanitizer --tool $tool, selfcheck --kvcache $flags" >> "$OUT/sanitizer.log"
      # shellcheck disable=SC2086
      compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 -m autoflash.selfcheck --kvcache --shape 3,6,2,4,300,128 --dtype bf16 $flags \
        >> "$OUT/sanitizer.log" 2>&1
      rc=$?
      echo "compute-sanitizer $tool (--kvcache $flags): exit $rc"
      status=$(( status | rc ))
    done
  done
  tail -12 "$OUT/sanitizer.log"
fi

if [[ $step == bench || $step == all ]]; then
  # FlashAttention's sweep, bf16, d 64 and 128, all directions; JSON + PNGs for bench/results/<device>/.
  python3 -m autoflash.bench --dtype bf16 --head-dims 64,128 --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
  status=$(( status | ${PIPESTATUS[0]} ))
  # Decode steps over KV caches (1k..128k) against SDPA: GB/s of K+V read and the share of HBM
  # bandwidth; dense and paged. Text into bench.log (the 8-file limit).
  for paging in "" "--page-size 256"; do
    # shellcheck disable=SC2086
    python3 -m autoflash.bench decode $paging 2>&1 | tee -a "$OUT/bench.log" | tail -20
    status=$(( status | ${PIPESTATUS[0]} ))
  done
fi
if [[ $step == tune ]]; then
  # Issue 6's tune: d 64,128 x fp16,bf16 x causal on/off x fwd,bwd, the 2k-4k bucket first (the
  # cheapest that says something); widen --seqlen-buckets when time allows. Resumable: rerun to go on.
  gpu=$(python3 -c "from autoflash.kernels.gpus import detect; print(detect().name)")
  python3 -m autoflash.tune --gpu "$gpu" --seqlen-buckets le4k --budget 30 --out "$OUT" --plot \
    --record-timings "$OUT/$gpu-timings.json" --no-progress 2>&1 | tee "$OUT/tune.log" | tail -30
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [[ $step == model ]]; then
  # The dispatcher's GPU checks: a 4-layer transformer trained with autoflash and with SDPA (loss
  # curves, tokens/s, torch.compile fullgraph vs eager), and the per-call overhead beside SDPA's.
  # 4 files: device.txt, model.log, train.json, dispatch.json.
  python3 -m autoflash.bench train --json "$OUT/train.json" 2>&1 | tee "$OUT/model.log" | tail -12
  status=$(( status | ${PIPESTATUS[0]} ))
  python3 -m autoflash.bench dispatch --json "$OUT/dispatch.json" 2>&1 | tee -a "$OUT/model.log" | tail -8
  status=$(( status | ${PIPESTATUS[0]} ))
fi
exit $status
