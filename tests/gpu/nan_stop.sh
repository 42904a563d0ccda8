#!/usr/bin/env bash
# A run that diverges stops at the first non-finite loss, naming the step and the last good
# checkpoint, which exists: 3 sound steps with a checkpoint each, then a resume with learning rates
# of 1e30, whose first update overflows the MLP. The loss of step 4 is still finite (it comes from
# checkpoint 3); step 5's is not, so checkpoint 4 (written, never confirmed) must not be named.
# The resume changes settings on purpose (--resume-other-settings).
# Exit 77 (skipped) without a GPU. Usage: nan_stop.sh <train_gpt binary>, from the repository root.
set -uo pipefail
nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU: skipped"; exit 77; }
trainer=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {
  "$trainer" --train-files "data/sample/sample_train_*.bin" --val-files "data/sample/sample_val_*.bin" \
    --num-iterations 20 --micro-batches 1 --seq-len 16384 --val-tokens 65536 --val-seq-len 65536 --val-every 0 \
    --warmup-steps 0 --checkpoint-every 1 --log-dir "$work/logs" --checkpoint-dir "$work/checkpoints" "$@"
}
run --num-iterations 3 >"$work/first.txt" 2>&1 || { cat "$work/first.txt"; echo "FAILED: the sound run failed"; exit 1; }
run --resume --resume-other-settings --adam-lr 1e30 --muon-lr 1e30 >"$work/console.txt" 2>"$work/errors.txt"
status=$?
cat "$work/errors.txt"
[[ $status -eq 1 ]] || { echo "FAILED: exit status $status, expected 1 (a stopped run)"; exit 1; }
message=$(grep -E '^error: training loss is (-?nan|-?inf) at step [0-9]+; last good checkpoint: ' "$work/errors.txt") ||
  { echo "FAILED: no error naming the non-finite training loss, its step and the last good checkpoint"; exit 1; }
checkpoint=${message##*last good checkpoint: }
[[ $message == *"at step 5;"* && $checkpoint == */step_000003.ckpt ]] ||
  { echo "FAILED: expected step 5 and checkpoint 3 (the last one whose parameters gave a finite loss)"; exit 1; }
[[ -f $checkpoint ]] || { echo "FAILED: the named checkpoint $checkpoint does not exist"; exit 1; }
echo "stopped as expected: $message"
