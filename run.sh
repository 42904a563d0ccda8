#!/usr/bin/env bash
# Builds the trainer if needed, finds the data and trains on the local GPUs: one process per GPU
# (NPROC: fewer, at most the GPUs nvidia-smi lists, CUDA_VISIBLE_DEVICES counted), ranks and
# rendezvous passed as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, a
# random free-looking port unless set). Started by a launcher (torchrun, mpirun, srun: its
# variables are set), it runs the one process the launcher asked for. SPEEDRUN_TRAINER names a
# trainer built elsewhere (a path from the caller's folder; no build here: what launchers on several
# nodes should use, and a record's frozen build). FineWeb shards in
# data/fineweb10B/ are used when present (python3 data/download_fineweb.py 8); otherwise the
# bundled sample in data/sample/, with a warning and smoke-run settings; neither when the flags
# name the training shards (--train-files). Extra flags are passed on and override those:
# ./run.sh --num-iterations 100
# Relative paths in the flags that take one (--train-files, --val-files, --checkpoint-dir,
# --log-dir) are from the caller's directory; the trainer runs in the repository, so the default
# logs/ and checkpoints/ are there. A rank that fails stops the others (SIGTERM, then SIGKILL after
# SPEEDRUN_STOP_GRACE seconds, 5 by default) and is named, with the end of its output.
# --ranks-share-gpu with NPROC=W: W ranks on a machine's one GPU, NCCL over loopback sockets (to
# test multi-rank NCCL with one GPU; refused where there are several GPUs).
# ./run.sh --help: this text, then the trainer's flags (when it is built; nothing is built for it).
set -euo pipefail
caller=$PWD
# a trainer named by a relative path is the caller's (run.sh works from the repository's root)
if [[ ${SPEEDRUN_TRAINER:-} == */* && ${SPEEDRUN_TRAINER} != /* ]]; then SPEEDRUN_TRAINER=$caller/$SPEEDRUN_TRAINER; fi
cd "$(dirname "$0")"

for arg in "$@"; do
  if [[ $arg == --help || $arg == -h ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    trainer=${SPEEDRUN_TRAINER:-./build/train_gpt}
    echo
    if [[ -x $trainer ]]; then
      exec $trainer --help
    fi
    echo "The trainer's flags: build it first (cmake --preset release && cmake --build build --target train_gpt), then ./run.sh --help."
    exit 0
  fi
done

if [[ -n ${NPROC:-} ]] && ! [[ $NPROC =~ ^[0-9]{1,4}$ && 10#$NPROC -ge 1 ]]; then
  echo "error: NPROC='$NPROC' is not a number of processes (a positive integer: one process per GPU)" >&2
  exit 2
fi
grace=${SPEEDRUN_STOP_GRACE:-5}
if ! [[ $grace =~ ^[0-9]{1,4}$ ]]; then
  echo "error: SPEEDRUN_STOP_GRACE='$grace' is not a whole number of seconds" >&2
  exit 2
fi

# A path flag's value, absolute from the caller's directory; in a glob (--train-files,
# --val-files) the directory's own *?[\ are escaped, so that the trainer's glob() takes them literally.
from_caller() {  # flag value
  local flag=$1 value=$2 dir=$caller
  if [[ -z $value || $value == /* ]]; then printf '%s' "$value"; return; fi
  [[ $flag == --train-files || $flag == --val-files ]] && dir=$(sed 's/[][*?\\]/\\&/g' <<<"$caller")
  printf '%s/%s' "$dir" "$value"
}
flags=() value_of=""
for arg in "$@"; do
  if [[ -n $value_of ]]; then
    flags+=("$(from_caller "$value_of" "$arg")")
    value_of=""
    continue
  fi
  case $arg in
    --train-files | --val-files | --checkpoint-dir | --log-dir)
      flags+=("$arg")
      value_of=$arg ;;
    --train-files=* | --val-files=* | --checkpoint-dir=* | --log-dir=*)
      flags+=("${arg%%=*}=$(from_caller "${arg%%=*}" "${arg#*=}")") ;;
    *) flags+=("$arg") ;;
  esac
done

# A launcher started this process (its rank): torchrun, mpirun, or srun with several tasks. Slurm
# sets SLURM_PROCID=0 in an sbatch script itself and in a one-task step (srun --pty bash) too: there
# run.sh is the launcher, and the trainer must not take Slurm's task count for the world size.
slurm_tasks=${SLURM_STEP_NUM_TASKS:-1}
launched=${RANK:-}${OMPI_COMM_WORLD_RANK:-}
if [[ -n ${SLURM_STEP_ID:-} && $slurm_tasks =~ ^[0-9]+$ ]] && ((10#$slurm_tasks > 1)); then
  launched+=${SLURM_PROCID:-}
elif [[ -z $launched ]]; then  # (salloc's shell sets SLURM_NTASKS alone)
  unset SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NTASKS_PER_NODE
fi
# How many processes, checked before the build (a launcher that started this process decided it).
nproc=1
if [[ -z $launched ]]; then
  # The GPUs this process may use: nvidia-smi's, or as many as CUDA_VISIBLE_DEVICES lists of them.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    listed=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    ((listed < gpus)) && gpus=$listed
  fi
  share_gpu=false
  for arg in "${flags[@]}"; do [[ $arg == --ranks-share-gpu ]] && share_gpu=true; done
  if $share_gpu; then
    # NPROC ranks on one GPU, on purpose: never where each rank can have its own.
    if [[ -z ${NPROC:-} ]] || ((10#$NPROC < 2)); then
      echo "error: --ranks-share-gpu puts NPROC ranks on one GPU: set NPROC=2 or more" >&2
      exit 2
    fi
    if ((gpus != 1)); then
      echo "error: --ranks-share-gpu puts every rank on one GPU, but this machine shows $gpus (nvidia-smi -L;" \
           "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-(unset)}): with several, leave the flag out (one process" \
           "per GPU) or show one (CUDA_VISIBLE_DEVICES=0)" >&2
      exit 2
    fi
    nproc=$((10#$NPROC))
  elif [[ -n ${NPROC:-} ]]; then
    nproc=$((10#$NPROC))
    if ((nproc > 1 && nproc > gpus)); then
      echo "error: NPROC=$NPROC is more than the $gpus GPU(s) this machine shows (nvidia-smi -L;" \
           "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-(unset)}): one process per GPU (--ranks-share-gpu" \
           "runs several on one GPU, to test multi-rank NCCL)" >&2
      exit 2
    fi
  else
    nproc=$gpus
    ((nproc >= 1)) || nproc=1  # no GPU seen: one process, which says why it cannot train
  fi
fi

trainer=${SPEEDRUN_TRAINER:-./build/train_gpt}  # the launcher's tests: a stand-in; acceptance.sh: a prebuilt one
if [[ -z ${SPEEDRUN_TRAINER:-} ]]; then
  # one build at a time: a node's ranks, each started by a launcher, would build into build/ at once
  mkdir -p build
  exec 9>build/.run_sh_build.lock
  if command -v flock >/dev/null && ! flock -n 9; then
    echo "run.sh: waiting for another process's build of build/ (build/.run_sh_build.lock)" >&2
    flock 9
  fi
  # 9>&-: the build's own processes (a build server that outlives it) do not hold the lock
  [[ -f build/CMakeCache.txt ]] || cmake --preset release >/dev/null 9>&-
  cmake --build --preset release --target train_gpt 9>&-
  exec 9>&-
fi

settings=() data=()
names_train_files=false
for arg in "${flags[@]}"; do [[ $arg == --train-files || $arg == --train-files=* ]] && names_train_files=true; done
if $names_train_files; then
  :  # the flags name the data and its settings: nothing added
elif compgen -G "data/fineweb10B/fineweb_train_*.bin" >/dev/null; then
  data=(--train-files "data/fineweb10B/fineweb_train_*.bin" --val-files "data/fineweb10B/fineweb_val_*.bin")
else
  data=(--train-files "data/sample/sample_train_*.bin" --val-files "data/sample/sample_val_*.bin")
  settings=(--num-iterations 30 --micro-batches 1 --seq-len 16384 --val-tokens 262144 --val-seq-len 65536 --val-every 10)
  echo "warning: no FineWeb shards in data/fineweb10B/ (python3 data/download_fineweb.py 8 fetches them);" \
       "using the bundled sample data/sample/ for a smoke run (not comparable with the record): ${settings[*]}" >&2
fi
args=("${data[@]}" "${settings[@]}" "${flags[@]}")

if ((nproc == 1)); then exec $trainer "${args[@]}"; fi  # one process, or a rank its launcher started

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

# Whether a rank is still running.
any_running() {
  local pid
  for pid in "${pids[@]}"; do [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}
# Stops the ranks still running: SIGTERM, then SIGKILL for those still there after $grace seconds.
stop_all() {
  local rank tick
  for rank in "${!pids[@]}"; do
    if [[ -n ${pids[$rank]} ]]; then kill "${pids[$rank]}" 2>/dev/null || true; fi
  done
  for ((tick = 0; tick < grace * 10; tick++)); do
    if ! any_running; then break; fi
    sleep 0.1
  done
  for rank in "${!pids[@]}"; do
    if [[ -n ${pids[$rank]} ]] && kill -0 "${pids[$rank]}" 2>/dev/null; then
      echo "error: rank $rank is still running $grace s after SIGTERM: sending SIGKILL" >&2
      kill -KILL "${pids[$rank]}" 2>/dev/null || true
    fi
  done
  for rank in "${!pids[@]}"; do
    if [[ -n ${pids[$rank]} ]]; then wait "${pids[$rank]}" 2>/dev/null || true; fi
  done
}
trap 'stop_all; exit 130' INT TERM

# How a rank ended, from its status: a status above 128 is a signal's (128 + its number).
how_it_ended() {  # status
  if (($1 > 128 && $1 <= 128 + 64)); then
    echo "was killed by SIG$(kill -l $(($1 - 128))) (signal $(($1 - 128)))"
  else
    echo "exited with status $1"
  fi
}

# The first rank to fail stops them all (NCCL would otherwise wait for it forever). Ranks above 0
# write to logs/rankR.out: the end of the failed one's is shown here.
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
      if ((rank == 0)); then
        echo "error: rank 0 $(how_it_ended "$status") (its output is above); stopping the other ranks" >&2
      else
        echo "error: rank $rank $(how_it_ended "$status"); the end of its output (logs/rank$rank.out):" >&2
        { tail -n 20 "logs/rank$rank.out" | sed 's/^/  | /' >&2; } || true
        echo "stopping the other ranks" >&2
      fi
      stop_all
      exit "$status"
    fi
  done
done
