#!/usr/bin/env bash
# Everything a GPU session checks, in one call on the GPU machine (device time is scarce): build,
# every gpu test (the smoke run of the trainer included), our kernel benchmark and PyTorch's beside
# it; a short summary table last. Outputs go to $OUT (the device tool's folder) or ./gpu_session/.
# Usage: tools/gpu_session.sh [--no-bench]
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

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
step configure cmake --preset release "${generator[@]}" || { printf '%s\n' "${status[@]}"; exit 1; }
step build cmake --build build -j "$(nproc)" || { printf '%s\n' "${status[@]}"; exit 1; }
step gpu_tests ctest --test-dir build -L gpu --output-on-failure --timeout 900
step cpu_tests ctest --test-dir build -L cpu --timeout 900
if [[ ${1:-} != --no-bench ]]; then
  step bench_kernels ./build/bench_kernels 20
  step bench_torch python3 tools/bench_torch.py --ours "$out/bench_kernels.txt"
fi
printf '\n| step | result | time |\n|---|---|---|\n'
printf '%s\n' "${status[@]}"
grep -hE "tests passed|tests failed|Passed|Failed|Skipped" "$out/gpu_tests.txt" | tail -20
