#!/usr/bin/env bash
# Runs a command that must fail in a given way: it passes when the command exits with STATUS and its
# output (stdout and stderr together) matches the extended regular expression MESSAGE.
# Usage: expect_exit.sh STATUS MESSAGE COMMAND [ARGUMENT]...
set -uo pipefail
status=$1 message=$2
shift 2
output=$("$@" 2>&1)
actual=$?
echo "$output"
[[ $actual == "$status" ]] || { echo "FAILED: exit status $actual, expected $status"; exit 1; }
grep -Eq -- "$message" <<<"$output" || { echo "FAILED: no line matches: $message"; exit 1; }
echo "exit status $status with the expected message"
