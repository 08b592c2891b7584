#!/usr/bin/env bash
# The first GPU run: env, smoke, GPU tests, fuzz, benchmarks; each step under its own timeout.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/run.log
step() { echo "=== $(date -u +%T) $*" >> $L; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> $L 2>&1 || echo "wheels failed" >> $L
export PYTHONPATH=$PWD:/tmp/site
step env
{ echo "commit $(cat .gpurun/commit)"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python3 -c "import sys,torch,cupy;print(sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'cupy',cupy.__version__)";
  python3 -m pip list 2>/dev/null | grep -iE "nvrtc|cuda-bindings|cuda-pathfinder|cuda-runtime|jinja2|pytest|optuna"; nproc; } >> $L 2>&1
step smoke
timeout 120 python3 .gpurun/smoke.py >> $L 2>&1; echo "smoke rc $?" >> $L
step pytest
timeout -s INT 180 python3 -m pytest -m gpu -n 16 --dist load -q -p no:cacheprovider --timeout 40 -rfE tests > $OUT/gpu-tests.log 2>&1
echo "pytest rc $?" >> $L; tail -5 $OUT/gpu-tests.log >> $L
step fuzz
timeout 60 python3 .gpurun/gpu_fuzz.py --cases 60 --json $OUT/fuzz.json > $OUT/fuzz.log 2>&1; echo "fuzz rc $?" >> $L; tail -3 $OUT/fuzz.log >> $L
step bench fwd
timeout 60 python3 -m autoflash.bench --direction fwd --dtype bf16 --head-dims 64,128,256 --seqlens 1k,4k,16k --causal both --backends autoflash,flash,cudnn --reps 10 --warmup 3 --no-plot --out $OUT/fwd >> $L 2>&1; echo "bench fwd rc $?" >> $L
step bench bwd
timeout 60 python3 -m autoflash.bench --direction bwd --dtype bf16 --head-dims 64,128 --seqlens 1k,4k,16k --causal both --backends autoflash,flash,cudnn --reps 10 --warmup 3 --no-plot --out $OUT/bwd >> $L 2>&1; echo "bench bwd rc $?" >> $L
step bench decode
timeout 40 python3 -m autoflash.bench decode --batches 1,16,64 --cache-lens 2k,16k,64k --reps 10 --json $OUT/decode.json >> $L 2>&1; echo "decode rc $?" >> $L
step done
