#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=$OUT/run3.log
echo "=== $(date -u +%T) nvrtcdiag" >> $L
for w in $(seq 0 15); do timeout 70 python3 .gpurun/nvrtcdiag.py $w >> $OUT/diag.log 2>&1 & done; wait
echo "=== $(date -u +%T) hostprof" >> $L
timeout 50 python3 .gpurun/hostprof.py > $OUT/hostprof.log 2>&1; echo "hostprof rc $?" >> $L
echo "=== $(date -u +%T) done" >> $L
