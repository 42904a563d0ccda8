#!/usr/bin/env bash
# Stands in for the trainer's self-check process (kernels/self_check_process.cuh) in
# test_trainer_host: the protocol's lines for the flash attention and FP8 head checks of the paths
# that SPEEDRUN_SELF_CHECK_PATHS switches on. Where the fused flash backward is on, its window-3
# check does what <mode> says: pass, hang, stop (the GPU stops), die (a signal ends the process);
# early: the process ends before any check (as it does where a profiler was injected into it).
# Usage: fake_self_check_process.sh <mode>
mode=$1
[[ $mode == early ]] && { echo "error: no GPU" >&2; exit 4; }
[[ -z ${CUDA_INJECTION64_PATH+set} ]] || { echo "error: a profiler was injected" >&2; exit 5; }
paths=" $SPEEDRUN_SELF_CHECK_PATHS "
on() { [[ $paths == *" $1=1 "* ]]; }
if on flash_attention; then
  for window in 1 3 14; do
    printf '@group\t1\n@spec\tflash attention\t0x1.47ae147ae147bp-7\tflash attention, window %s\n' "$window"
    if on fused_attention_backward && [[ $window == 3 ]]; then
      case $mode in
        hang) exec sleep 60 ;;
        stop) printf '@stopped\tan illegal memory access was encountered\n'; exit 1 ;;
        die) kill -SEGV $$ ;;
      esac
    fi
    printf '@result\tflash attention\t0x1p-9\t0x1.47ae147ae147bp-7\tflash attention, window %s\t\n' "$window"
  done
fi
if on fp8_head; then
  printf '@group\t1\n@spec\tFP8 head\t0x1p-7\tFP8 head logits\n'
  printf '@result\tFP8 head\t0x1p-10\t0x1p-7\tFP8 head logits\t\n'
fi
echo "a line of the process's own"
echo "@done"
