#!/usr/bin/env bash
# Builds the trainer if needed, finds the data and runs it on the local GPU(s).
# FineWeb shards in data/fineweb10B/ are used when present (python3 data/download_fineweb.py 8);
# otherwise the bundled sample in data/sample/, with a warning: enough for a smoke run, not a record.
set -euo pipefail
cd "$(dirname "$0")"

[[ -f build/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target train_gpt

if compgen -G "data/fineweb10B/fineweb_train_*.bin" >/dev/null; then
  train="data/fineweb10B/fineweb_train_*.bin"
  val="data/fineweb10B/fineweb_val_*.bin"
else
  echo "warning: no FineWeb shards in data/fineweb10B/ (python3 data/download_fineweb.py 8 fetches them);" \
       "using the bundled sample data/sample/ (a smoke run, not comparable with the record)" >&2
  train="data/sample/sample_train_*.bin"
  val="data/sample/sample_val_*.bin"
fi
exec ./build/train_gpt --train-files "$train" --val-files "$val" "$@"
