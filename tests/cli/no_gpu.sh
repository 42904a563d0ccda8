#!/usr/bin/env bash
# On a machine without a GPU (CI), the trainer checks everything else first, then says in plain
# words that no NVIDIA driver or GPU was found and exits 4; with a GPU it would train: skipped (77).
# Usage: no_gpu.sh TRAINER [FLAG]... (flags of a run whose other checks pass)
nvidia-smi -L >/dev/null 2>&1 && { echo "a GPU is present: skipped"; exit 77; }
exec bash "$(dirname "$0")/expect_exit.sh" 4 "^error: no NVIDIA (driver|GPU) found" "$@"
