#!/usr/bin/env bash
# The compile tier under every NVRTC our users get besides the one the main run has (the newest 13.x,
# beside CPU torch): the oldest and newest each extra admits, and the one pip resolves beside torch's
# newest CUDA build of each major (.ci/check_cuda_deps.py: 13.0.88 beside CUDA torch 2.14.1, which
# pins it; 12.8.93 beside torch 2.10's CUDA 12 build).
# Each is a small venv over the main environment that holds only that NVRTC, the CUDA headers of its
# release and cuda-bindings of its major. Per run, one default of each (family, arch, direction,
# decode) and one of each release-dependent choice (kernels/defaults.py STACK_SPILLS) compile
# through the gate with zero spills and no C75xx notice, each release its own draw of the run's seed
# (tests/test_compile.py stack_defaults; AUTOFLASH_SWEEP=full for all 448), and one launch of each
# kernel kind matches its cubin's parameter table (tests/test_driver_seams.py).
#   bash .ci/nvrtc_stacks.sh            # every stack below
#   bash .ci/nvrtc_stacks.sh 13.0.88    # one
#   bash .ci/nvrtc_stacks.sh --prepare  # only make the venvs (network, little CPU: .ci/run overlaps
#                                       # it with the main tests)
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A STACKS=(
  [12.1.105]="nvidia-cuda-nvrtc-cu12==12.1.105 nvidia-cuda-runtime-cu12==12.1.105 cuda-bindings==12.9.10"
  [12.8.93]="nvidia-cuda-nvrtc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90 cuda-bindings==12.9.4"
  [12.9.86]="nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 cuda-bindings==12.9.10"
  [13.0.48]="nvidia-cuda-nvrtc==13.0.48 nvidia-cuda-runtime==13.0.48"
  [13.0.88]="nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.88"
)
ORDER=(13.0.88 12.8.93 12.9.86 12.1.105 13.0.48)
prepare_only=0
if [ "${1:-}" = "--prepare" ]; then prepare_only=1; shift; fi
[ $# -gt 0 ] && ORDER=("$@")
ROOT="${AUTOFLASH_NVRTC_VENVS:-${TMPDIR:-/tmp}/autoflash-nvrtc}"

prepare() {  # the venv of release $1, made once
  local venv="$ROOT/$1"
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    python3 -m venv --system-site-packages "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q ${STACKS[$1]} 2>&1 | grep -v -e "dependency resolver" -e "cuda-python" || true
    touch "$venv/.ready"
  fi
}

if [ $prepare_only = 1 ]; then
  for release in "${ORDER[@]}"; do prepare "$release" & done
  wait
  exit 0
fi

status=0
for release in "${ORDER[@]}"; do
  venv="$ROOT/$release"
  prepare "$release"
  got=$("$venv/bin/python" -c "from autoflash.kernels.compiler import nvrtc_version as v; print(v())")
  [ "$got" = "${release%.*}" ] || { echo "NVRTC $release: the venv compiles with NVRTC $got"; exit 1; }
  echo "== compile tier under NVRTC $release (venv $venv)"
  AUTOFLASH_NVRTC_STACK="$release" AUTOFLASH_CACHE_DIR="${AUTOFLASH_CACHE_DIR:-$HOME/.cache/autoflash}" \
    "$venv/bin/python" -m pytest -q -n 0 -p no:cacheprovider -p no:benchmark tests/test_compile.py tests/test_driver_seams.py \
    -k "default_configs or cubins" || status=1
done
exit $status
