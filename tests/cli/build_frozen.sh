#!/usr/bin/env bash
# A frozen single-file trainer builds alone with exactly the command its third line documents (as a
# new user would run it, in a folder holding only the file: tools/build_frozen.sh) and answers --help
# as the trainer does;
# TRAINER "-" (a committed record: the trainer of its day, whose flags today's need not share) only
# that it answers --help with its usage.
# Usage: build_frozen.sh FROZEN_FILE TRAINER|- WORK_DIR [NVCC_DIR] (NVCC_DIR: put first on PATH, where
# the toolkit's nvcc is not on it already)
set -euo pipefail
frozen=$1 trainer=$2 work=$3
[[ -n ${4:-} ]] && PATH="$4:$PATH"
bash "$(dirname "$0")/../../tools/build_frozen.sh" "$frozen" "$work"
# The CUDA libraries the command links are found at run time as the documented build finds them
# at link time: in the toolkit's lib64 when the system's loader path lacks it.
toolkit_lib=$(dirname "$(dirname "$(command -v nvcc)")")/lib64
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$toolkit_lib"
if [[ $trainer == - ]]; then
  help=$("$work/train_gpt" --help) && [[ $help == "usage: "* ]] || { echo "the frozen build does not answer --help"; exit 1; }
  echo "$frozen: built alone with its documented command; it answers --help"
  exit 0
fi
diff <("$trainer" --help | sed "s|$trainer|PROGRAM|") <("$work/train_gpt" --help | sed "s|$work/train_gpt|PROGRAM|") \
  || { echo "--help differs between $trainer and the frozen build"; exit 1; }
echo "$frozen: built alone with its documented command; --help as the trainer's"
