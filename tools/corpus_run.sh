#!/usr/bin/env bash
# Trainer runs on the offline corpus (../shared/data/corpus: 43M train tokens, the recipe's 10.5M
# validation tokens, FineWeb's format), for the GPU machine, where ../shared does not exist:
#   tools/corpus_run.sh stage       here: copy the compressed shards into .carry/corpus/ (ignored by
#                                   git), and record #25's train_gpt.py into .carry/anchor/ (for
#                                   tools/acceptance.sh anchor and profile: ../shared does not travel);
#                                   send them with the device tool's carry: [".carry"]
#   tools/corpus_run.sh unpack      there: the shards into corpus-bin/, checked against SHA256SUMS
#   tools/corpus_run.sh steps [K]   there: step time of M = 1 and M = 8 (and M = 8 through a
#                                   one-rank NCCL communicator) over the window schedule of a K-step
#                                   run (default 20), tokens/s and MFU, as a table; then where step 5
#                                   of the M = 8 run spent its time (its timeline, also into $OUT)
#   tools/corpus_run.sh full [N] [flag...]
#                                   there: N (default 1) runs of the recipe on one GPU as the issue
#                                   asks: M = 1, 860 iterations, validation of 10,485,760 tokens every
#                                   125 steps, the trainer's flags given after N added (e.g.
#                                   --matrix-optimizer rekls); logs in logs/ (packed into
#                                   $OUT/corpus-logs.tar.gz after each run when OUT is set),
#                                   then their statistics against TARGET (default 2.67, the corpus's
#                                   stated target)
#   tools/corpus_run.sh stage-record records/<date>_<name>
#                                   here: that record's frozen file built with its documented command
#                                   into .carry/<date>_<name>/train_gpt (carried with the corpus)
#   tools/corpus_run.sh record records/<date>_<name> [N]
#                                   there: N (default 2) runs of that build, `full`'s recipe, in the
#                                   record's folder (a trainer of 2026-11-26 logs the train_gpt.cu of
#                                   its working directory as its source); logs in logs/ and packed
#                                   into $OUT/record-logs.tar.gz after each run: copy them into the
#                                   record's folder, then `python3 tools/records.py table`
# Builds build/train_gpt first (not with SPEEDRUN_PREBUILT=1: a build made elsewhere, used as it
# is). The corpus holds 876 M = 1 steps (109 at M = 8): the loader must never cycle, so K and the
# iterations stay within that.
set -euo pipefail
cd "$(dirname "$0")/.."
staged=.carry/corpus
shards=corpus-bin
trainer=build/train_gpt
# Every temporary folder (the runs' checkpoints, the step runs' logs) lies in one, removed at exit
# whatever the exit.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

unpack() {
  mkdir -p "$shards"
  for f in "$staged"/*.bin.xz; do
    [[ -f $shards/$(basename "$f" .xz) ]] || xz -dc "$f" >"$shards/$(basename "$f" .xz)"
  done
  (cd "$shards" && sha256sum --quiet -c "../$staged/SHA256SUMS")
}

build_trainer() {
  local generator=()
  if [[ -n ${SPEEDRUN_PREBUILT:-} ]]; then  # built elsewhere: used as it is (tools/acceptance.sh)
    tools/stage_build.sh unpack  # what tools/stage_build.sh staged, where build/ has no trainer
    [[ -x $trainer ]] || { echo "SPEEDRUN_PREBUILT: $trainer is missing" >&2; return 1; }
    return 0
  fi
  [[ ! -f build/CMakeCache.txt ]] && command -v ninja >/dev/null && generator=(-G Ninja)
  cmake --preset release "${generator[@]}" >/dev/null
  cmake --build build -j "$(nproc)" --target train_gpt >/dev/null
}

data_flags=(--train-files "$shards/corpus_train_*.bin" --val-files "$shards/corpus_val_*.bin")

# mean step time (ms) of a finished run log: its last train_time over its steps
mean_step_ms() {
  grep -E '^step:[0-9]+/[0-9]+ train_time:' "$1" | tail -1 |
    sed -E 's#^step:([0-9]+)/[0-9]+ train_time:([0-9.]+)ms.*#\2 \1#' | awk '{ printf "%.1f", $1 / $2 }'
}

steps() {
  local K=${1:-20}
  printf '| M | communicator | tokens/step | mean step (ms) | tokens/s | MFU (6N, vs 989 TFLOP/s) |\n|---|---|---|---|---|---|\n'
  for run in "1 none" "8 none" "8 nccl"; do
    local M=${run% *} comm=${run#* } name="M${run% *}_${run#* }" extra=()
    [[ $comm == nccl ]] && extra=(--nccl-single-rank)
    [[ $name == M8_none ]] && extra=(--timeline-step 5)
    # --stall-timeout: a kernel that hangs ends its run in 2 minutes, not the device call in 10
    "$trainer" "${data_flags[@]}" --micro-batches "$M" --num-iterations "$K" --val-every 0 --val-tokens 262144 \
      --warmup-steps 3 --stall-timeout 120 --log-dir "$work/logs_$name" --checkpoint-dir "$work/checkpoints" \
      "${extra[@]}" >"$work/console_$name.txt"
    local ms tokens
    ms=$(mean_step_ms "$(ls "$work/logs_$name"/*.txt)")
    tokens=$((M * 49152))
    # MFU of the console lines scales with tokens/s: take the ratio from the last one
    awk -v m="$M" -v c="$comm" -v t="$tokens" -v ms="$ms" -v last="$(grep -E 'tok/s:' "$work/console_$name.txt" | tail -1)" 'BEGIN {
      match(last, /tok\/s:[0-9.]+/); tps = substr(last, RSTART + 6, RLENGTH - 6)
      match(last, /mfu:[0-9.]+/); mfu = substr(last, RSTART + 4, RLENGTH - 4)
      rate = t / (ms / 1000)
      printf "| %d | %s | %d | %.1f | %.0f | %.1f%% |\n", m, c, t, ms, rate, mfu * rate / tps }'
  done
  local trace=$work/logs_M8_none/timeline_rank0_step5.json
  echo
  python3 tools/timeline_summary.py "$trace"
  if [[ -n ${OUT:-} ]]; then cp "$trace" "$OUT/"; fi
}

# recipe_runs <trainer> <folder> <logs name> <N> [flag...]: N runs of the recipe on one GPU in the
# folder (the trainer's working directory; the corpus and the logs found from the repository root),
# each log packed into $OUT/<logs name>.tar.gz after every run, then their statistics.
recipe_runs() {
  local trainer=$1 folder=$2 name=$3 runs=$4 root=$PWD before new=() f
  shift 4
  mkdir -p logs
  before=$(ls logs)
  for ((i = 0; i < runs; ++i)); do
    (cd "$folder" && "$trainer" --train-files "$root/$shards/corpus_train_*.bin" --val-files "$root/$shards/corpus_val_*.bin" \
      --micro-batches 1 --num-iterations 860 --val-every 125 --checkpoint-dir "$work/checkpoints_$i" \
      --log-dir "$root/logs" "$@") || echo "run $((i + 1)) of $runs: the trainer stopped with exit $?" >&2
    new=()
    for f in logs/*.txt; do grep -qxF "$(basename "$f")" <<<"$before" || new+=("$f"); done
    # One file back however many runs (the device tool brings back 8 at most), after every run: a
    # call cut short still brings back the runs it finished.
    if [[ -n ${OUT:-} ]] && ((${#new[@]})); then
      tar -czf "$OUT/$name.tar.gz.part" "${new[@]}" && mv "$OUT/$name.tar.gz.part" "$OUT/$name.tar.gz" ||
        rm -f "$OUT/$name.tar.gz.part"
    fi
  done
  ((${#new[@]})) || { echo "no run wrote a log" >&2; return 1; }
  python3 tools/records.py stats "${new[@]}" --target "${TARGET:-2.67}" || true
}

full() {
  local runs=${1:-1}
  shift || true
  recipe_runs "$PWD/$trainer" . corpus-logs "$runs" "$@"
}

# The frozen build of a committed record, staged by `stage-record` in .carry/<its name>/.
record_build() { echo ".carry/$(basename "$1")/train_gpt"; }

stage_record() {
  local folder=${1%/}
  [[ -f $folder/train_gpt.cu ]] || { echo "error: $folder/train_gpt.cu: no such record (records/<date>_<name>)" >&2; return 2; }
  tools/build_frozen.sh "$folder/train_gpt.cu" "$work/frozen" || return 1
  mkdir -p "$(dirname "$(record_build "$folder")")"
  mv "$work/frozen/train_gpt" "$(record_build "$folder")"
  echo "$(record_build "$folder"): $folder's frozen file, built with its documented command"
  tools/stage_build.sh size
}

record() {
  local folder=${1%/} runs=${2:-2} build
  build=$PWD/$(record_build "$folder")
  [[ -x $build ]] || { echo "error: $build is missing: tools/corpus_run.sh stage-record $folder, here" >&2; return 1; }
  recipe_runs "$build" "$folder" record-logs "$runs"
}

case ${1:-} in
  stage)
    mkdir -p "$staged" .carry/anchor
    cp ../shared/data/corpus/*.bin.xz ../shared/data/corpus/SHA256SUMS "$staged/"
    cp ../shared/anchor/record25/train_gpt.py .carry/anchor/
    tools/stage_build.sh size
    ;;
  stage-record) stage_record "${2:?usage: $0 stage-record records/<date>_<name>}" ;;
  unpack) unpack ;;
  record) unpack && record "${2:?usage: $0 record records/<date>_<name> [N]}" "${3:-2}" ;;
  steps) unpack && build_trainer && steps "${2:-20}" ;;
  full) unpack && build_trainer && full "${@:2}" ;;
  *) sed -n "2,32p" "$0" >&2; exit 2 ;;
esac
