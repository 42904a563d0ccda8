#!/usr/bin/env bash
# Builds a frozen single-file trainer (tools/records.py) alone with exactly the command its third line
# documents, as a new user would: in WORK_DIR (emptied first) holding only the file, the binary
# WORK_DIR/train_gpt. Used by tools/corpus_run.sh stage-record and the tests' build of every record.
# Usage: tools/build_frozen.sh FROZEN_FILE WORK_DIR
set -euo pipefail
frozen=$1 work=$2
command=$(sed -n '3s|^//   ||p' "$frozen")
[[ $command == "nvcc "* ]] || { echo "error: $frozen: line 3 is not its build command: $(sed -n 3p "$frozen")" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work" && cp "$frozen" "$work/train_gpt.cu"
echo "in $work: $command"
(cd "$work" && bash -c "$command")
