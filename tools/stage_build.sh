#!/usr/bin/env bash
# Stages what a GPU machine runs from build/ into .carry/build/ (ignored by git), for the device
# tool's carry, which takes 64 MiB in all: with the corpus (tools/corpus_run.sh stage, ~41 MB) there
# is room for the binaries, not for build/ whole. Kept: the trainer, bench_kernels, the kernel
# profiler, the test binaries, CTest's files and the scripts beside them; left out: object files,
# CMake's own files, the emulated tests (CPU only), the frozen trainers' builds and the generated
# sources (compiled in already). On the GPU machine, with SPEEDRUN_PREBUILT=1, tools/acceptance.sh and
# tools/corpus_run.sh copy .carry/build/ into build/ where build/ has no trainer (the same toolkit at
# the same paths: CTest's files name them). In a configured build/ it first brings what the GPU
# machine runs up to date (`--target gpu_tests bench_kernels`): without a GPU at configure time, the
# gpu tests that compile the whole trainer are not part of `all`, so a plain build leaves them as
# an earlier build made them, and they would be carried stale. Usage: tools/stage_build.sh
# (SPEEDRUN_STAGE_JOBS: the build's parallel jobs, default 2).
# SPEEDRUN_BASELINE=<commit>: also builds that commit's trainer and bench_kernels (in a git worktree
# with a build/ of its own) into .carry/baseline/, its commit in .carry/baseline/REVISION, so that
# acceptance.sh's anchor and bench phases run them beside this build in the same call: the before
# and after of every change since, on one card. Without it a baseline staged earlier is carried as it
# is (this script says which).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .carry/build  # a failure below leaves no earlier staging to be carried by mistake
if [[ -n ${SPEEDRUN_BASELINE:-} ]]; then
  rm -rf .carry/baseline
  baseline=$(git rev-parse --verify -q "${SPEEDRUN_BASELINE}^{commit}") ||
    { echo "error: SPEEDRUN_BASELINE=$SPEEDRUN_BASELINE is not a commit of this repository" >&2; exit 1; }
  tree=$(mktemp -d)
  trap 'git worktree remove --force "$tree/src" >/dev/null 2>&1; rm -rf "$tree"' EXIT
  git worktree add -q --detach "$tree/src" "$baseline"
  (cd "$tree/src" && cmake --preset release >/dev/null &&
    cmake --build build -j "${SPEEDRUN_STAGE_JOBS:-2}" --target train_gpt bench_kernels >/dev/null) ||
    { echo "error: building the baseline ${baseline:0:7}'s train_gpt and bench_kernels failed" >&2; exit 1; }
  mkdir -p .carry/baseline
  cp -p "$tree/src/build/train_gpt" "$tree/src/build/bench_kernels" .carry/baseline/
  echo "$baseline" >.carry/baseline/REVISION
fi
[[ -f .carry/baseline/REVISION ]] && echo ".carry/baseline: the trainer and bench_kernels of $(cut -c1-7 .carry/baseline/REVISION)"
if [[ -f build/CMakeCache.txt ]]; then
  cmake --build build -j "${SPEEDRUN_STAGE_JOBS:-2}" --target gpu_tests bench_kernels ||
    { echo "error: building gpu_tests and bench_kernels failed: nothing staged" >&2; exit 1; }
fi
[[ -x build/train_gpt ]] || { echo "error: build/train_gpt is missing: build first (cmake --build build)" >&2; exit 1; }
mkdir -p .carry/build
(cd build && find . \( -name CMakeFiles -o -path ./tests/emulator -o -path ./tests/frozen_trainer_alone \
                       -o -path ./frozen -o -path ./generated -o -path ./Testing \) -prune \
                    -o -type f ! -name '*.o' ! -name '*.d' ! -name '.ninja_*' -print) |
  while read -r f; do
    mkdir -p ".carry/build/$(dirname "$f")"
    cp -p "build/$f" ".carry/build/$f"
  done
limit=$((64 * 1024 * 1024))
bytes=$(du -cb .carry | tail -1 | cut -f1)
echo ".carry/build: $(du -sh .carry/build | cut -f1); .carry in all: $((bytes / 1024 / 1024)) MiB of the carry's 64"
if ((bytes > limit)); then
  echo "error: .carry is over the device tool's 64 MiB: leave something out" >&2
  exit 1
fi
