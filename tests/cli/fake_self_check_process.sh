#!/usr/bin/env bash
# Stands in for the trainer's self-check process (kernels/self_check_process.cuh) in
# test_trainer_host: the protocol's lines for the flash attention, FP8 head and qkv backward checks
# of the paths that SPEEDRUN_SELF_CHECK_PATHS switches on, but the groups SPEEDRUN_SELF_CHECK_DONE
# names. <mode> says what one check does: pass (none fails); hang, stop (the GPU stops), die (a
# signal ends the process): the fused flash backward's window-3 check; hang-fp8: the FP8 head's;
# early: the process ends before any check (as it does where a profiler was injected into it);
# fail-after-done: it exits 1 after its last line; cut-off: its last line has no newline.
# Usage: fake_self_check_process.sh <mode>
mode=$1
[[ $mode == early ]] && { echo "error: no GPU" >&2; exit 4; }
[[ -z ${CUDA_INJECTION64_PATH+set} ]] || { echo "error: a profiler was injected" >&2; exit 5; }
[[ $SPEEDRUN_SELF_CHECK_PARENT == "$PPID" ]] || { echo "error: not the trainer's child" >&2; exit 6; }
paths=" $SPEEDRUN_SELF_CHECK_PATHS "
on() { [[ $paths == *" $1=1 "* ]]; }
done_groups=$'\t'"$SPEEDRUN_SELF_CHECK_DONE"$'\t'
# check <path> <name> <what it does>: one group of one check, reported as the trainer's process does
check() {
  [[ $done_groups == *$'\t'"$2"$'\t'* ]] && return
  printf '@group\t1\n@spec\t%s\t0x1.47ae147ae147bp-7\t%s\n' "$1" "$2"
  case $3 in
    hang) exec sleep 60 ;;
    stop) printf '@stopped\tan illegal memory access was encountered\n'; exit 1 ;;
    die) kill -KILL $$ ;;
  esac
  printf '@result\t%s\t0x1p-9\t0x1.47ae147ae147bp-7\t%s\t\n' "$1" "$2"
}
if on flash_attention; then
  for window in 1 3 14; do
    does=pass
    on fused_attention_backward && [[ $window == 3 ]] && does=$mode
    check "flash attention" "flash attention, window $window" "$does"
  done
fi
if on fp8_head; then
  check "FP8 head" "FP8 head logits" "$([[ $mode == hang-fp8 ]] && echo hang)"
fi
if on flash_attention && on fused_attention_backward && on qkv_backward_in_attention; then
  check "qkv backward in attention" "qkv backward in attention, window 14" pass
fi
echo "a line of the process's own"
case $mode in
  fail-after-done) echo "@done"; exit 1 ;;
  cut-off) printf '@done' ;;
  *) echo "@done" ;;
esac
