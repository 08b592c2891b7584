#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
L=$OUT/run2.log
step() { echo "=== $(date -u +%T) $*" >> $L; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> $L 2>&1
export PYTHONPATH=$PWD:/tmp/site
step profile  # .gpurun/profile.py is scripts/call_time.py here
timeout 70 python3 .gpurun/profile.py > $OUT/profile.log 2>&1; echo "profile rc $?" >> $L
step dispatch
timeout 40 python3 -m autoflash.bench dispatch --json $OUT/dispatch.json >> $L 2>&1; echo "dispatch rc $?" >> $L
step decode
timeout 45 python3 -m autoflash.bench decode --batches 1,16,64 --cache-lens 2k,16k,64k --reps 10 --json $OUT/decode.json >> $L 2>&1; echo "decode rc $?" >> $L
step pytest
timeout -s INT 150 python3 -m pytest -m gpu -n 16 --dist load -q -p no:cacheprovider --timeout 90 -rfE tests/test_gpu_forward.py tests/test_gpu_backward.py tests/test_gpu_dispatch.py tests/test_kvcache.py > $OUT/gpu-tests2.log 2>&1
echo "pytest rc $?" >> $L; tail -5 $OUT/gpu-tests2.log >> $L
step done
