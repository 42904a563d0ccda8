#!/usr/bin/env bash
# Writes the bad inputs that the trainer's refusal tests read, into FOLDER (emptied first):
#   tokens/train_000.bin, val_000.bin   good shards of 2,000 tokens
#   tokens/train_001.bin, val_001.bin   the same but for their last token, 50300 (>= GPT-2's 50257)
#   damaged/step_000003.ckpt            a checkpoint cut off after its step
#   ranked/rank1/step_000002.ckpt       the same in rank 1's folder of a two-rank run
#   fifo/train_000.bin                  a named pipe where a shard should be (a scan would block on it)
# Usage: write_bad_inputs.sh FOLDER
set -euo pipefail
folder=$1
rm -rf "$folder"
mkdir -p "$folder/tokens" "$folder/damaged" "$folder/ranked/rank1" "$folder/fifo"
mkfifo "$folder/fifo/train_000.bin"

# Little-endian bytes of an integer: le WIDTH VALUE.
le() {
  local i
  for ((i = 0; i < $1; i++)); do printf "\\x$(printf %02x $(($2 >> 8 * i & 255)))"; done
}
# A FineWeb shard (SPEC 1.7: magic 20240520, version 1, the token count, 256 int32 in all) of COUNT
# tokens, all 0 but the last: write_shard FILE COUNT LAST.
write_shard() {
  { le 4 20240520; le 4 1; le 4 "$2"; head -c $((253 * 4 + 2 * ($2 - 1))) /dev/zero; le 2 "$3"; } >"$1"
}
write_shard "$folder/tokens/train_000.bin" 2000 1
write_shard "$folder/tokens/train_001.bin" 2000 50300
write_shard "$folder/tokens/val_000.bin" 2000 1
write_shard "$folder/tokens/val_001.bin" 2000 50300
{ printf SPDRCKP2; le 8 3; } >"$folder/damaged/step_000003.ckpt"
{ printf SPDRCKP2; le 8 2; } >"$folder/ranked/rank1/step_000002.ckpt"
