#!/usr/bin/env bash
# run.sh's launcher without a GPU: NPROC processes with torchrun's variables, all finishing; and
# one rank failing stops the others at once, with the rank named and its status returned.
set -uo pipefail
cd "$(dirname "$0")/../.."
fake=tests/launcher/fake_rank.sh
out=$(NPROC=3 RUN_SECONDS=0.2 SPEEDRUN_TRAINER=$fake ./run.sh --seed 7 2>&1)
rc=$?
echo "$out"
[[ $rc == 0 ]] || { echo "FAILED: run.sh exited $rc with 3 healthy ranks"; exit 1; }
grep -q "rank 0 of 3 (local 0 of 3) master 127.0.0.1:" <<<"$out" || { echo "FAILED: rank 0's environment"; exit 1; }
grep -q "rank 2 of 3" logs/rank2.out || { echo "FAILED: rank 2's output is not in logs/rank2.out"; exit 1; }
grep -q -- "--seed 7" logs/rank1.out || { echo "FAILED: flags are not passed on"; exit 1; }

start=$SECONDS
out=$(NPROC=4 FAIL_RANK=2 SPEEDRUN_TRAINER=$fake ./run.sh 2>&1)
rc=$?
echo "$out"
[[ $rc == 3 ]] || { echo "FAILED: run.sh returned $rc, not the failed rank's status 3"; exit 1; }
grep -q "error: rank 2 exited with status 3 (its output: logs/rank2.out); stopping the other ranks" <<<"$out" ||
  { echo "FAILED: the failed rank is not named"; exit 1; }
((SECONDS - start < 20)) || { echo "FAILED: the other ranks were not stopped"; exit 1; }

# Shards named on the command line: no sample fallback, no smoke-run settings (one rank: the flags
# are on its output line).
out=$(NPROC=1 RUN_SECONDS=0 SPEEDRUN_TRAINER=$fake RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
  MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ./run.sh --train-files "/data/train_*.bin" --val-files "/data/val_*.bin" 2>&1)
echo "$out"
grep -q -- "args: --train-files /data/train_\*.bin --val-files /data/val_\*.bin$" <<<"$out" ||
  { echo "FAILED: run.sh added data or settings to the shards the flags name"; exit 1; }
grep -q "warning" <<<"$out" && { echo "FAILED: a sample warning with the shards named"; exit 1; }
rm -f logs/rank[0-9]*.out
echo "launcher test passed"
