#!/usr/bin/env bash
# Rebuilds data/sample/ (the bundled offline sample, < 4 MB) from the compressed corpus in
# ../shared/data/corpus/: the first 2 x 262,144 + 2 validation tokens (two validation sequences
# of the record's length) and the first 1,400,000 training tokens (28 steps of 49,152 tokens).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED_DIR:-$(dirname "$repo")/shared}
if [[ ! -x $shared/data/unpack.sh ]]; then
  echo "error: $shared/data/unpack.sh not found: this script rebuilds data/sample/ from the offline corpus" \
    "of the development folder beside the checkout (SHARED_DIR=<folder> names another); data/sample/ is" \
    "committed, so a clone needs it only to change the sample" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$shared/data/unpack.sh" "$work" >/dev/null

# cut SRC DEST N: the first N tokens of shard SRC as a shard of its own (header rewritten).
cut_shard() {
  python3 - "$1" "$2" "$3" <<'PY'
import struct, sys
src, dest, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(src, "rb") as f:
    header = list(struct.unpack("<256i", f.read(1024)))
    assert header[0] == 20240520 and header[1] == 1 and header[2] >= n, f"{src}: unexpected header"
    tokens = f.read(2 * n)
header[2] = n
with open(dest, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(tokens)
PY
}

cut_shard "$work/corpus_val_000000.bin" "$repo/data/sample/sample_val_000000.bin" $((2 * 262144 + 2))
cut_shard "$work/corpus_train_000001.bin" "$repo/data/sample/sample_train_000001.bin" 1400000
ls -l "$repo/data/sample/"*.bin
