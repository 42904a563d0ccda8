#!/usr/bin/env bash
# Stages what a GPU machine runs from build/ into .carry/build.tar.xz (ignored by git), for the
# device tool's carry, which takes 64 MiB in all: with the corpus (tools/corpus_run.sh stage, 42 MB)
# there is room for the binaries, compressed (about 23 MB as files, 5 as the archive), not for build/
# whole. Kept: the trainer, bench_kernels, the kernel profiler, the test binaries, CTest's files and
# the scripts beside them; left out: object files, CMake's own files, the emulated tests (CPU only),
# the frozen trainers' builds and the generated sources (compiled in already). In a configured
# build/ it first brings what the GPU machine runs up to date (`--target gpu_tests bench_kernels`):
# without a GPU at configure time, the gpu tests are not part of `all`, so a plain build leaves them
# as an earlier build made them, and they would be carried stale.
# SPEEDRUN_BASELINE=<commit>: also builds that commit's trainer and bench_kernels (in a git worktree
# with a build/ of its own) into .carry/baseline.tar.xz, with its commit (REVISION), so that
# acceptance.sh's anchor and bench phases run them beside this build in the same call: the before
# and after of every change since, on one card. Without it a baseline staged earlier is carried as it
# is (this script says which).
# On the GPU machine, with SPEEDRUN_PREBUILT=1, tools/acceptance.sh and tools/corpus_run.sh run
# `tools/stage_build.sh unpack`: the archive into build/ where build/ has no trainer (the same
# toolkit at the same paths: CTest's files name them), the baseline's into .carry/baseline/.
# `tools/stage_build.sh size`: whether what a device call sends (the files git tracks or does not
# ignore, and .carry) fits the tool's 64 MiB (tools/corpus_run.sh stage asks too).
# Usage: tools/stage_build.sh [unpack|size] (SPEEDRUN_STAGE_JOBS: the builds' parallel jobs, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

# What a device call sends, against its limit: the working tree that travels and the carried .carry.
check_size() {
  local limit=$((64 * 1024 * 1024)) tree carry
  tree=0  # outside a git checkout (the tests' stand-in trees) only .carry is counted
  if git rev-parse --git-dir >/dev/null 2>&1; then
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  fi
  carry=$(du -cb .carry 2>/dev/null | tail -1 | cut -f1)
  echo "what a device call sends: the tree $((tree / 1024 / 1024)) MiB + .carry $((carry / 1024 / 1024)) MiB of the tool's 64"
  if ((tree + carry > limit)); then
    echo "error: over the device tool's 64 MiB: leave something out of .carry (or the tree)" >&2
    return 1
  fi
}

if [[ ${1:-} == unpack ]]; then
  if [[ ! -x build/train_gpt && -f .carry/build.tar.xz ]]; then
    mkdir -p build && tar -xJf .carry/build.tar.xz -C build
  fi
  if [[ ! -x .carry/baseline/train_gpt && -f .carry/baseline.tar.xz ]]; then
    mkdir -p .carry/baseline && tar -xJf .carry/baseline.tar.xz -C .carry/baseline
  fi
  exit 0
fi
if [[ ${1:-} == size ]]; then
  check_size
  exit
fi
(($# == 0)) || { echo "usage: $0 [unpack|size]" >&2; exit 2; }

# a failure below leaves no earlier staging to be carried by mistake; .carry/baseline/ is the unpacked
# form, on the GPU machine, never carried
rm -rf .carry/build .carry/build.tar.xz .carry/baseline
if [[ -n ${SPEEDRUN_BASELINE:-} ]]; then
  rm -f .carry/baseline.tar.xz
  baseline=$(git rev-parse --verify -q "${SPEEDRUN_BASELINE}^{commit}") ||
    { echo "error: SPEEDRUN_BASELINE=$SPEEDRUN_BASELINE is not a commit of this repository" >&2; exit 1; }
  tree=$(mktemp -d)
  trap 'git worktree remove --force "$tree/src" >/dev/null 2>&1; rm -rf "$tree"' EXIT
  git worktree add -q --detach "$tree/src" "$baseline"
  (cd "$tree/src" && cmake --preset release >/dev/null &&
    cmake --build build -j "${SPEEDRUN_STAGE_JOBS:-2}" --target train_gpt bench_kernels >/dev/null) ||
    { echo "error: building the baseline ${baseline:0:7}'s train_gpt and bench_kernels failed" >&2; exit 1; }
  echo "$baseline" >"$tree/src/build/REVISION"
  mkdir -p .carry
  tar -cJf .carry/baseline.tar.xz -C "$tree/src/build" train_gpt bench_kernels REVISION
fi
if [[ -f .carry/baseline.tar.xz ]]; then
  echo ".carry/baseline.tar.xz: the trainer and bench_kernels of $(tar -xJOf .carry/baseline.tar.xz REVISION | cut -c1-7)"
fi
if [[ -f build/CMakeCache.txt ]]; then
  cmake --build build -j "${SPEEDRUN_STAGE_JOBS:-2}" --target gpu_tests bench_kernels ||
    { echo "error: building gpu_tests and bench_kernels failed: nothing staged" >&2; exit 1; }
fi
[[ -x build/train_gpt ]] || { echo "error: build/train_gpt is missing: build first (cmake --build build)" >&2; exit 1; }
mkdir -p .carry
(cd build && find . \( -name CMakeFiles -o -path ./tests/emulator -o -path ./tests/frozen_trainer_alone \
                       -o -path ./frozen -o -path ./generated -o -path ./Testing \) -prune \
                    -o -type f ! -name '*.o' ! -name '*.d' ! -name '.ninja_*' -print) >.carry/build.files
tar -cJf .carry/build.tar.xz -C build -T .carry/build.files
rm .carry/build.files
echo ".carry/build.tar.xz: $(du -sh .carry/build.tar.xz | cut -f1)"
check_size
