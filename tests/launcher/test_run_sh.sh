#!/usr/bin/env bash
# run.sh's launcher without a GPU, with stand-in ranks (fake_rank.sh), one case per call:
#   launcher                      NPROC processes with torchrun's variables, all finishing; one rank
#                                 failing stops the others at once, named, its status returned; shards
#                                 named on the command line get no sample settings
#   refuses_bad_nproc             NPROC=abc, NPROC=0 and a bad SPEEDRUN_STOP_GRACE are refused
#                                 (status 2), nothing started
#   refuses_nproc_above_gpus      NPROC above the GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES
#                                 counted; none: NPROC 1 only) is refused (status 2), nothing started
#                                 and nothing built
#   ranks_share_gpu               --ranks-share-gpu starts NPROC ranks on a machine showing one GPU,
#                                 and is refused with several GPUs or fewer than 2 ranks
#   help_without_building         ./run.sh --help prints its own usage, then the trainer's flags when
#                                 it is built, and builds nothing
#   slurm_script                  tools/slurm_speedrun.sbatch under stand-in scontrol and srun: rank
#                                 0's address from the node list, the prebuilt trainer, the flags on
#   names_killing_signal          a rank killed by SIGKILL is named with its signal (status 137)
#   kills_ranks_ignoring_sigterm  a rank that ignores SIGTERM gets SIGKILL after SPEEDRUN_STOP_GRACE
#   shows_failed_rank_output      a failed rank above 0 has the end of its output on the console
#   paths_from_caller             relative paths in the path flags are from the caller's directory
#   sample_settings               the sample fallback's settings are in its warning and its README
#   launched_ranks_build_one_at_a_time  ranks a launcher started (RANK set) build one after another
#   trainer_from_caller           a relative SPEEDRUN_TRAINER is taken from the caller's folder
#   slurm_without_srun            in an sbatch script or a one-task step run.sh starts the ranks itself
#                                 (Slurm's task variables hidden from them); a task of srun's step of
#                                 several is a rank
# nvidia-smi is a stand-in (tests/launcher/nvidia-smi) listing FAKE_GPUS GPUs, 4 unless set.
# Usage: test_run_sh.sh CASE
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
fake=$repo/tests/launcher/fake_rank.sh
fail() { echo "FAILED: $*"; exit 1; }
# A command with stand-in ranks, VAR=value words first: its output in $out, its status in $rc.
launch() {
  out=$(env PATH="$repo/tests/launcher:$PATH" SPEEDRUN_TRAINER="$fake" "$@" 2>&1)
  rc=$?
  echo "$out"
}
# The last launch exited with STATUS and printed a line that matches MESSAGE (a grep pattern).
expect() {
  [[ $rc == "$1" ]] || fail "exit status $rc, expected $1"
  grep -q -- "$2" <<<"$out" || fail "no line matches: $2"
}
# One process, as a launcher would start it: its flags are on its output line.
one_rank() { launch RUN_SECONDS=0 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 "$@"; }

launcher() {
  launch NPROC=3 RUN_SECONDS=0.2 ./run.sh --seed 7
  expect 0 "rank 0 of 3 (local 0 of 3) master 127.0.0.1:"
  grep -q "rank 2 of 3" logs/rank2.out || fail "rank 2's output is not in logs/rank2.out"
  grep -q -- "--seed 7" logs/rank1.out || fail "flags are not passed on"

  start=$SECONDS
  launch NPROC=4 FAIL_RANK=2 ./run.sh
  expect 3 "^error: rank 2 exited with status 3; the end of its output (logs/rank2.out):"
  grep -q "^stopping the other ranks" <<<"$out" || fail "the other ranks are not said to be stopped"
  ((SECONDS - start < 20)) || fail "the other ranks were not stopped"

  one_rank ./run.sh --train-files "/data/train_*.bin" --val-files "/data/val_*.bin"
  expect 0 "args: --train-files /data/train_\*.bin --val-files /data/val_\*.bin$"
  grep -q "warning" <<<"$out" && fail "a sample warning with the shards named"
}

refuses_bad_nproc() {
  rm -f logs/rank[0-9]*.out
  for nproc in abc 0 -1 2x; do
    launch NPROC=$nproc ./run.sh
    expect 2 "^error: NPROC='$nproc' is not a number of processes (a positive integer: one process per GPU)$"
    grep -q "rank 0 of" <<<"$out" && fail "NPROC=$nproc started a rank"
  done
  launch NPROC=2 SPEEDRUN_STOP_GRACE=soon ./run.sh
  expect 2 "^error: SPEEDRUN_STOP_GRACE='soon' is not a whole number of seconds$"
}

refuses_nproc_above_gpus() {
  rm -f logs/rank[0-9]*.out
  launch FAKE_GPUS=2 NPROC=3 ./run.sh
  expect 2 "^error: NPROC=3 is more than the 2 GPU(s) this machine shows (nvidia-smi -L; CUDA_VISIBLE_DEVICES=(unset)): one process per GPU (--ranks-share-gpu runs several on one GPU, to test multi-rank NCCL)$"
  grep -q "rank 0 of" <<<"$out" && fail "NPROC=3 started a rank on 2 GPUs"
  launch FAKE_GPUS=8 CUDA_VISIBLE_DEVICES=3,5 NPROC=3 ./run.sh
  expect 2 "^error: NPROC=3 is more than the 2 GPU(s) this machine shows (nvidia-smi -L; CUDA_VISIBLE_DEVICES=3,5)"
  launch FAKE_GPUS=0 NPROC=9999 ./run.sh
  expect 2 "^error: NPROC=9999 is more than the 0 GPU(s) this machine shows"
  launch FAKE_GPUS=2 NPROC=2 RUN_SECONDS=0 ./run.sh
  expect 0 "rank 0 of 2 (local 0 of 2)"
  # refused before the build: a stand-in cmake says so if it is called
  stand_in=$(mktemp -d)
  printf '#!/usr/bin/env bash\necho "cmake called: $*"\nexit 9\n' >"$stand_in/cmake"
  chmod +x "$stand_in/cmake"
  launch PATH="$stand_in:$repo/tests/launcher:$PATH" SPEEDRUN_TRAINER= FAKE_GPUS=2 NPROC=3 ./run.sh
  rm -rf "$stand_in"
  expect 2 "^error: NPROC=3 is more than the 2 GPU(s)"
  grep -q "cmake called" <<<"$out" && fail "NPROC=3 was checked only after the build"
}

ranks_share_gpu() {
  rm -f logs/rank[0-9]*.out
  launch FAKE_GPUS=1 NPROC=3 RUN_SECONDS=0 ./run.sh --ranks-share-gpu
  expect 0 "rank 0 of 3 (local 0 of 3) master 127.0.0.1:.* args: .*--ranks-share-gpu"
  grep -q "rank 2 of 3" logs/rank2.out || fail "the third rank did not start on the one GPU"
  for gpus in 2 4; do
    launch FAKE_GPUS=$gpus NPROC=$gpus ./run.sh --ranks-share-gpu
    expect 2 "^error: --ranks-share-gpu puts every rank on one GPU, but this machine shows $gpus (nvidia-smi -L;"
  done
  launch FAKE_GPUS=8 CUDA_VISIBLE_DEVICES=0 NPROC=2 RUN_SECONDS=0 ./run.sh --ranks-share-gpu
  expect 0 "rank 0 of 2"
  for nproc in "" 1; do
    launch FAKE_GPUS=1 NPROC=$nproc ./run.sh --ranks-share-gpu
    expect 2 "^error: --ranks-share-gpu puts NPROC ranks on one GPU: set NPROC=2 or more$"
  done
  grep -q "rank 0 of" <<<"$out" && fail "a refused --ranks-share-gpu started a rank"
  return 0
}

help_without_building() {
  launch SPEEDRUN_TRAINER=/nonexistent/train_gpt ./run.sh --seed 3 --help
  expect 0 "^Builds the trainer if needed, finds the data and trains on the local GPUs"
  grep -q "^The trainer's flags: build it first" <<<"$out" || fail "no word on the trainer's flags"
  grep -q "NPROC" <<<"$out" || fail "run.sh's usage does not name NPROC"
  helper=$(mktemp)
  printf '#!/usr/bin/env bash\necho "the trainer says: $*"\n' >"$helper"
  chmod +x "$helper"
  launch SPEEDRUN_TRAINER="$helper" ./run.sh -h
  rm -f "$helper"
  expect 0 "^the trainer says: --help$"
}

trainer_from_caller() {
  # a relative SPEEDRUN_TRAINER is the caller's path, as the path flags are
  caller=$(mktemp -d)
  cp "$fake" "$caller/my_trainer"
  (cd "$caller" && env PATH="$repo/tests/launcher:$PATH" FAKE_GPUS=1 RUN_SECONDS=0 SPEEDRUN_TRAINER=./my_trainer \
    "$repo/run.sh" --seed 9) >"$caller/out.txt" 2>&1
  rc=$?
  out=$(cat "$caller/out.txt")
  rm -rf "$caller"
  echo "$out"
  expect 0 "args: .*--seed 9$"
}

slurm_script() {
  stand_ins=$(mktemp -d)
  printf '#!/usr/bin/env bash\n[[ $1 == show && $2 == hostnames ]] && printf "gpu-a7\\ngpu-a8\\n"\n' >"$stand_ins/scontrol"
  # srun: task 0 of a step of 2, as srun would start it (its variables), running the command it was given
  printf '#!/usr/bin/env bash\nshift\nSLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_NTASKS_PER_NODE=1 exec "$@"\n' \
    >"$stand_ins/srun"
  chmod +x "$stand_ins/scontrol" "$stand_ins/srun"
  out=$(env PATH="$stand_ins:$PATH" SLURM_JOB_NODELIST="gpu-a[7-8]" SLURM_SUBMIT_DIR="$repo" SPEEDRUN_TRAINER="$fake" \
    RUN_SECONDS=0 bash tools/slurm_speedrun.sbatch --seed 4 2>&1)
  rc=$?
  rm -rf "$stand_ins"
  echo "$out"
  [[ $rc == 0 ]] || fail "exit status $rc"
  grep -q "^rank  of  (local  of ) master gpu-a7:29500 slurm task 0 of 2 pid .* args: .*--seed 4$" <<<"$out" ||
    fail "the rank did not get MASTER_ADDR=gpu-a7, MASTER_PORT=29500 and the flags"
}

names_killing_signal() {
  launch NPROC=2 KILL_RANK=1 ./run.sh
  expect 137 "^error: rank 1 was killed by SIGKILL (signal 9); the end of its output (logs/rank1.out):"
}

kills_ranks_ignoring_sigterm() {
  start=$SECONDS
  launch NPROC=3 FAIL_RANK=2 IGNORE_TERM_RANK=1 SPEEDRUN_STOP_GRACE=1 ./run.sh
  expect 3 "^error: rank 1 is still running 1 s after SIGTERM: sending SIGKILL$"
  grep -q "^error: rank 0 is still running" <<<"$out" && fail "rank 0 stopped on SIGTERM, yet got SIGKILL"
  ((SECONDS - start < 20)) || fail "run.sh waited for the rank that ignores SIGTERM"
  pid=$(sed -n 's/.* pid \([0-9]*\) args:.*/\1/p' logs/rank1.out)
  [[ -n $pid ]] || fail "no pid in logs/rank1.out"
  kill -0 "$pid" 2>/dev/null && { kill -KILL "$pid"; fail "rank 1 (pid $pid) is still running"; }
  return 0
}

shows_failed_rank_output() {
  launch NPROC=2 FAIL_RANK=1 ./run.sh
  expect 3 "^  | error: rank 1's stand-in failure$"
}

paths_from_caller() {
  caller=$(mktemp -d)/'odd[1]'  # glob characters in the caller's directory are taken literally
  mkdir -p "$caller"
  cd "$caller"
  one_rank "$repo/run.sh" --train-files "mydata/train_*.bin" --val-files=mydata/val.bin --checkpoint-dir ck \
    --log-dir=/abs/logs --seed 5
  cd "$repo"
  rm -rf "$(dirname "$caller")"
  escaped=${caller//[/\\[}
  escaped=${escaped//]/\\]}
  expected="args: --train-files $escaped/mydata/train_*.bin --val-files=$escaped/mydata/val.bin --checkpoint-dir $caller/ck --log-dir=/abs/logs --seed 5"
  [[ $rc == 0 ]] && grep -qF -- "$expected" <<<"$out" || fail "expected '$expected'"
}

launched_ranks_build_one_at_a_time() {
  # a stand-in cmake that notes a build begun while another runs
  stand_in=$(mktemp -d)
  printf '#!/usr/bin/env bash\n[[ $1 == --build ]] || exit 0\nmkdir "%s/building" 2>/dev/null || { echo OVERLAP; exit 0; }\nsleep 0.5\nrmdir "%s/building"\n' \
    "$stand_in" "$stand_in" >"$stand_in/cmake"
  chmod +x "$stand_in/cmake"
  for r in 0 1 2; do  # the trainer each execs then refuses the flag (or is not built): only the builds matter
    env -u SPEEDRUN_TRAINER PATH="$stand_in:$PATH" RANK=$r ./run.sh --not-a-flag >"$stand_in/rank$r.out" 2>&1 &
  done
  wait
  overlaps=$(cat "$stand_in"/rank*.out | grep -c OVERLAP)
  rm -rf "$stand_in"
  ((overlaps == 0)) || fail "$overlaps of 3 ranks began their build while another's ran"
}

slurm_without_srun() {
  # an sbatch script's own shell (or a one-task step) has SLURM_PROCID=0 and the job's task count:
  # run.sh is the launcher there, and its ranks do not see Slurm's task variables
  launch FAKE_GPUS=2 RUN_SECONDS=0 SLURM_JOB_ID=7 SLURM_PROCID=0 SLURM_NTASKS=8 SLURM_LOCALID=0 \
    SLURM_NTASKS_PER_NODE=8 ./run.sh
  expect 0 "^rank 0 of 2 (local 0 of 2) master 127.0.0.1:[0-9]* slurm task none of none pid"
  grep -q "^rank 1 of 2 .* slurm task none of none" logs/rank1.out || fail "rank 1 saw Slurm's task variables"
  launch FAKE_GPUS=1 RUN_SECONDS=0 SLURM_STEP_ID=3 SLURM_STEP_NUM_TASKS=1 SLURM_PROCID=0 SLURM_NTASKS=1 ./run.sh
  expect 0 "^rank  of  (local  of ) master : slurm task none of none pid"
  # a task of a step of several is a rank already: run.sh starts it alone, with Slurm's variables
  launch FAKE_GPUS=2 RUN_SECONDS=0 SLURM_STEP_ID=3 SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=1 SLURM_NTASKS=2 ./run.sh
  expect 0 "^rank  of  (local  of ) master : slurm task 1 of 2 pid"
}

sample_settings() {
  if compgen -G "data/fineweb10B/fineweb_train_*.bin" >/dev/null; then
    echo "FineWeb shards present: run.sh does not fall back to the sample here (nothing to check)"
    return 0
  fi
  one_rank ./run.sh
  settings=$(sed -n 's/^warning: .*using the bundled sample .*: \(--.*\)$/\1/p' <<<"$out")
  [[ -n $settings ]] || fail "the warning does not state the settings"
  grep -q -- "args: .* $settings$" <<<"$out" || fail "the warning's settings are not the ones passed on"
  grep -qF -- "$settings" data/sample/README.md || fail "data/sample/README.md does not state '$settings'"
}

case=${1:?usage: test_run_sh.sh CASE}
declare -F "$case" >/dev/null || fail "no case '$case'"
"$case"
rm -f logs/rank[0-9]*.out
echo "run.sh case $case passed"
