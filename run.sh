#!/usr/bin/env bash
# Builds the trainer if needed, finds the data and trains on the local GPUs: one process per GPU
# (NPROC overrides the count), ranks and rendezvous passed as torchrun does (RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Started by a launcher (torchrun, mpirun, srun: its
# variables are set), it runs the one process the launcher asked for. FineWeb shards in
# data/fineweb10B/ are used when present (python3 data/download_fineweb.py 8); otherwise the
# bundled sample in data/sample/, with a warning and smoke-run settings; neither when the flags
# name the training shards (--train-files). Extra flags are passed on and override those:
# ./run.sh --num-iterations 100
set -euo pipefail
cd "$(dirname "$0")"

trainer=${SPEEDRUN_TRAINER:-./build/train_gpt}  # another command only in the launcher's tests
if [[ -z ${SPEEDRUN_TRAINER:-} ]]; then
  [[ -f build/CMakeCache.txt ]] || cmake --preset release >/dev/null
  cmake --build --preset release --target train_gpt
fi

settings=() data=()
names_train_files=false
for arg in "$@"; do [[ $arg == --train-files || $arg == --train-files=* ]] && names_train_files=true; done
if $names_train_files; then
  :  # the flags name the data and its settings: nothing added
elif compgen -G "data/fineweb10B/fineweb_train_*.bin" >/dev/null; then
  data=(--train-files "data/fineweb10B/fineweb_train_*.bin" --val-files "data/fineweb10B/fineweb_val_*.bin")
else
  echo "warning: no FineWeb shards in data/fineweb10B/ (python3 data/download_fineweb.py 8 fetches them);" \
       "using the bundled sample data/sample/ for a 30-step smoke run (not comparable with the record)" >&2
  data=(--train-files "data/sample/sample_train_*.bin" --val-files "data/sample/sample_val_*.bin")
  settings=(--num-iterations 30 --micro-batches 1 --seq-len 16384 --val-tokens 262144 --val-seq-len 65536 --val-every 10)
fi
args=("${data[@]}" "${settings[@]}" "$@")

if [[ -n ${RANK:-}${OMPI_COMM_WORLD_RANK:-}${SLURM_PROCID:-} ]]; then exec $trainer "${args[@]}"; fi
nproc=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[[ $nproc =~ ^[0-9]+$ && $nproc -ge 1 ]] || nproc=1
if ((nproc == 1)); then exec $trainer "${args[@]}"; fi

export WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc MASTER_ADDR=127.0.0.1
export MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
mkdir -p logs
pids=()
for ((rank = 0; rank < nproc; rank++)); do
  if ((rank == 0)); then
    RANK=$rank LOCAL_RANK=$rank $trainer "${args[@]}" &
  else
    RANK=$rank LOCAL_RANK=$rank $trainer "${args[@]}" >"logs/rank$rank.out" 2>&1 &
  fi
  pids+=($!)
done
# Stops the ranks still running.
stop_all() {
  local live=()
  for pid in "${pids[@]}"; do [[ -n $pid ]] && live+=("$pid"); done
  ((${#live[@]} == 0)) || { kill "${live[@]}" 2>/dev/null || true; wait "${live[@]}" 2>/dev/null || true; }
}
trap 'stop_all; exit 130' INT TERM

# The first rank to fail stops them all (NCCL would otherwise wait for it forever).
running=$nproc
while ((running > 0)); do
  sleep 0.2
  for rank in "${!pids[@]}"; do
    pid=${pids[$rank]}
    [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null || continue
    status=0
    wait "$pid" || status=$?
    pids[$rank]=""
    running=$((running - 1))
    if ((status != 0)); then
      output="logs/rank$rank.out"
      ((rank > 0)) || output="above"
      echo "error: rank $rank exited with status $status (its output: $output); stopping the other ranks" >&2
      stop_all
      exit "$status"
    fi
  done
done
