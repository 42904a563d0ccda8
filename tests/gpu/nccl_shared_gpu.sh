#!/usr/bin/env bash
# Multi-rank NCCL on any GPU machine, one GPU enough: the trainer at W = 2 through run.sh with
# --ranks-share-gpu (both ranks on GPU 0, NCCL's socket transport over the loopback; on a machine
# with several GPUs, CUDA_VISIBLE_DEVICES=0 shows it one) against W = 1 on the same data, 4 steps of
# the distributed oracle's settings (tools/acceptance.sh nccl); every rank's final parameters
# within the GPU oracle's fp32 bound of W = 1's (tools/compare_checkpoints.py); then W = 2 resumed
# where one rank lacks the newest checkpoint, to the same end. Exit 77 (skipped) without a GPU or
# without numpy.
# Usage: nccl_shared_gpu.sh <train_gpt binary>, from the repository root.
set -euo pipefail
nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU: skipped"; exit 77; }
python3 -c "import numpy" 2>/dev/null || { echo "numpy is missing (tools/compare_checkpoints.py needs it): skipped"; exit 77; }
export SPEEDRUN_TRAINER=$1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}  # one GPU, shared
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(--train-files "data/sample/sample_train_*.bin" --val-files "data/sample/sample_val_*.bin"
  --seq-len 4096 --micro-batches 8 --num-iterations 4 --seed 1234 --warmup-steps 0 --val-every 0
  --val-tokens 32768 --val-seq-len 4096 --stall-timeout 120 --log-dir "$work/logs" --checkpoint-every 2)
for W in 1 2; do
  share=()
  ((W > 1)) && share=(--ranks-share-gpu)
  start=$SECONDS
  NPROC=$W ./run.sh "${flags[@]}" "${share[@]}" --checkpoint-dir "$work/W$W" >"$work/W$W.txt" 2>&1 ||
    { tail -40 "$work/W$W.txt"; ((W > 1)) && tail -40 logs/rank1.out; echo "FAILED: the W = $W run"; exit 1; }
  echo "W = $W: $((SECONDS - start)) s"
done
grep -m1 "^--ranks-share-gpu:" "$work/W2.txt" || { echo "FAILED: the W = 2 run did not share the GPU"; exit 1; }
python3 tools/compare_checkpoints.py --bound 0.1 "$work"/W1/step_000004.ckpt "$work"/W2/rank*/step_000004.ckpt
# A run stopped while its ranks wrote step 4's checkpoints (rank 1's missing): --resume takes step 2,
# the newest every rank holds, and trains to the same step 4
rm "$work"/W2/rank1/step_000004.ckpt
touch "$work/before_resume"
NPROC=2 ./run.sh "${flags[@]}" --ranks-share-gpu --checkpoint-dir "$work/W2" --resume >"$work/W2-resumed.txt" 2>&1 ||
  { tail -40 "$work/W2-resumed.txt"; tail -40 logs/rank1.out; echo "FAILED: the W = 2 resume"; exit 1; }
grep -m1 "resumed from .*/step_000002.ckpt at step 2 (the newest step every rank holds" "$work/W2-resumed.txt" ||
  { echo "FAILED: the resume did not take step 2, the newest step both ranks held"; exit 1; }
[[ "$work"/W2/rank0/step_000004.ckpt -nt "$work/before_resume" ]] ||
  { echo "FAILED: rank 0's step 4 checkpoint was not written again by the resumed run"; exit 1; }
python3 tools/compare_checkpoints.py --bound 0.1 "$work"/W1/step_000004.ckpt "$work"/W2/rank*/step_000004.ckpt
