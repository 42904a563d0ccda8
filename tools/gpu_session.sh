#!/usr/bin/env bash
# Everything a GPU session checks, on the GPU machine (device time is scarce), in phases that each
# fit one device call (600 s): `build` (configure, build, the fast gpu tests), `slow` (the gpu
# tests labelled slow, side by side: minutes of CPU reference each), `bench` (our kernel benchmark
# and PyTorch's beside it), or `all`. Every phase configures and builds first: the machine goes
# back 30 s after a call, so a later phase usually starts bare (and on a warm one the build is a
# no-op). Only the gpu tests' targets and the benchmark are built: the cpu tests (the emulated
# ones, the frozen trainers) are CI's. Outputs go to $OUT (the device tool's folder) or
# ./gpu_session/; a short summary table comes last.
# Usage: tools/gpu_session.sh [build|slow|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_session}
mkdir -p "$out"
status=()
step() {  # step <name> <command...>: runs it, keeps its output in $out/<name>.txt, records the result
  local name=$1
  shift
  local start=$SECONDS
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  status+=("| $name | $([[ $rc == 0 ]] && echo ok || echo "FAILED (rc $rc)") | $((SECONDS - start)) s |")
  tail -n 40 "$out/$name.txt"
  return $rc
}

phase=${1:-all}
case $phase in build | slow | bench | all) ;; *) echo "usage: $0 [build|slow|bench|all]"; exit 2 ;; esac
generator=()
[[ ! -f build/CMakeCache.txt ]] && command -v ninja >/dev/null && generator=(-G Ninja)
step configure cmake --preset release "${generator[@]}" || { printf '%s\n' "${status[@]}"; exit 1; }
step build cmake --build build -j "$(nproc)" --target gpu_tests bench_kernels || { printf '%s\n' "${status[@]}"; exit 1; }
if [[ $phase == build || $phase == all ]]; then
  step gpu_tests ctest --test-dir build -L gpu -LE slow --output-on-failure --timeout 900
fi
if [[ $phase == slow || $phase == all ]]; then
  step slow_gpu_tests ctest --test-dir build -L slow -j 3 --output-on-failure --timeout 900
fi
if [[ $phase == bench || $phase == all ]]; then
  step bench_kernels ./build/bench_kernels 20
  step bench_torch python3 tools/bench_torch.py --ours "$out/bench_kernels.txt"
fi
printf '\n| step | result | time |\n|---|---|---|\n'
printf '%s\n' "${status[@]}"
for log in "$out"/gpu_tests.txt "$out"/slow_gpu_tests.txt; do
  [[ -f $log ]] && grep -hE "tests passed|tests failed|Passed|Failed|Skipped" "$log" | tail -20
done
