#!/usr/bin/env bash
# 30 steps of the real trainer binary on the bundled sample (data/sample/, cut from the offline
# corpus): the run finishes, every validation loss is finite, and the last is well below the first
# (ln(50304) = 10.83 with the zero-initialised head). Exit 77 (skipped) without a GPU.
# Usage: smoke_run.sh <train_gpt binary>, from the repository root.
set -euo pipefail
nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU: skipped"; exit 77; }
trainer=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$trainer" --train-files "data/sample/sample_train_*.bin" --val-files "data/sample/sample_val_*.bin" \
  --num-iterations 30 --micro-batches 1 --seq-len 16384 --val-tokens 262144 --val-seq-len 65536 \
  --val-every 10 --warmup-steps 2 --log-dir "$work/logs" --checkpoint-dir "$work/checkpoints" | tee "$work/console.txt"
log=$(ls "$work"/logs/*.txt)
echo "the trainer reports: $(grep -m1 '^Running CUDA driver' "$log")"  # versions, for tools/acceptance.sh
# the start-up self-check ran (in its own processes) and every fast path passed
grep -qE '^self-check: [0-9]+ checks, 0 failed' "$log" || { echo "FAILED: no passing self-check summary in $log"; exit 1; }
losses=$(grep -E '^step:[0-9]+/30 val_loss:' "$log" | sed -E 's/.*val_loss:([^ ]+).*/\1/')
echo "validation losses: $(echo $losses)"
[[ $(echo "$losses" | wc -l) -eq 4 ]] || { echo "FAILED: expected 4 validation lines in $log"; exit 1; }
first=$(echo "$losses" | head -1) last=$(echo "$losses" | tail -1)
awk -v a="$first" -v b="$last" 'BEGIN { ok = (a == a + 0) && (b == b + 0) && b < a - 1.0; exit ok ? 0 : 1 }' ||
  { echo "FAILED: validation loss $first -> $last (must fall by more than 1.0, finite)"; exit 1; }
[[ -f "$work/checkpoints/step_000030.ckpt" ]] || { echo "FAILED: no final checkpoint"; exit 1; }
echo "smoke run passed: $first -> $last"
