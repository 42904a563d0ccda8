#!/usr/bin/env bash
# The acceptance of a GPU machine: run it first on new hardware, before any training run. Phases,
# each within one 10-minute device call on one H100 (on a bare machine each first builds what it
# runs, only that):
#   build       configure build/ and build what the phases run (gpu_tests, bench_kernels)
#   tests       the gpu tests but the slow ones and the smoke run (ctest -L gpu -LE slow -j 4: their CPU
#               references side by side)
#   sanitize    the kernels' tests under compute-sanitizer at the CI-sized shapes (SPEEDRUN_TEST_SUBSET=1:
#               the emulator's subset, on the GPU), each run's first finding named by its source line
#               (every CUDA target carries -lineinfo): memcheck over the kernel tests and the
#               trainer (2 steps on the bundled sample, its default and its opt-in paths), synccheck and
#               racecheck over the hand-written Hopper kernels' (default_sanitize_runs below;
#               SANITIZE_RUNS="tool:test[:case] ..." others); a run is stopped after ACCEPTANCE_SANITIZE_TIMEOUT
#               (120 s), and none starts once the phase, its build included, has taken
#               ACCEPTANCE_SANITIZE_BUDGET (420 s). racecheck's hazards on buffers that TMA writes or
#               wgmma reads (the async proxy) are to be read against the kernel's mbarrier protocol
#               before they are believed
#   slow        the slow gpu tests side by side (ctest -L slow -j 3): minutes of CPU reference each
#   smoke       the trainer's 30-step smoke run on the bundled sample (tests/gpu/smoke_run.sh)
#   self-check  the trainer's start-up self-check on each GPU (--self-check strict --self-check-only)
#   bench       our kernel benchmark, then PyTorch's ops beside it (the ratios); with a staged baseline,
#               its bench_kernels too, and the rows both name side by side (now / baseline)
#   anchor      record #25's own PyTorch code beside the trainer on this GPU, the trainer first: 20
#               steps at M = 8 and 60 at M = 1 on the offline corpus, each program's mean step, and
#               the ratio (tools/record_pytorch.py; the corpus and the record's file staged by
#               tools/corpus_run.sh stage); ANCHOR_VARIANTS="flags;flags..." adds runs of the
#               trainer with those flags after its own, each in the table (e.g. a kernel's previous
#               version behind a flag, measured in the same call), and whether each printed the trainer's
#               own losses (the same seed: a variant that changes no arithmetic must); "@bench" in a
#               variant stands for the bench phase's fastest --matmul-algorithms value, "@bench-fp8"
#               for its fastest --fp8-logits-algorithm (from an earlier call on the same machine:
#               build/bench_<flag>.txt, else the report's line), so that the anchor's call needs
#               nothing read from the bench's; a run of the trainer whose start-up self-check replaced
#               fast paths (its time is then other kernels') says which, in its rows;
#               ANCHOR_RUNS="M:N ..." other runs
#               than "8:20 1:60" (each run costs about 45 s of the trainer, 40-150 s of the record's
#               code: "8:20" alone fits five variants into one device call)
#               A baseline staged by tools/stage_build.sh (SPEEDRUN_BASELINE: an earlier commit's
#               trainer and bench_kernels in .carry/baseline.tar.xz) runs too, after the variants, and a
#               table gives ours / baseline: the step before and after, on one card in one call
#   profile     every kernel's time in step 5 of 6 at M = 8, the trainer's and the record code's
#               (build/libkernel_profile.so through --profile-step; tools/profile_summary.py), and where
#               ncu reads hardware counters, those of the attention and cross-entropy kernels
#   nccl        the distributed oracle over real NCCL ranks, one process per GPU (with one GPU, W
#               ranks share it: --ranks-share-gpu, NCCL over loopback sockets): the trainer at
#               W = 2, 4 and all GPUs in every --grad-comm mode against W = 1
#               on the same data, compared parameter by parameter (tools/compare_checkpoints.py);
#               then Streaming DiLoCo in 2 groups at W = 2 (and 4): its communicator splits and
#               exchanges over NCCL, the trainer checking that all ranks agree after the final sync;
#               last, 2 ranks started with different flags must both stop, saying so
#               (ACCEPTANCE_DISAGREEING_FLAGS_TIMEOUT, 150 s, ends a hang)
# No argument runs them all, in this order; arguments run the phases named, in the order given.
# One report: logs/acceptance-<host>-<date>.md (ACCEPTANCE_REPORT names another); each call adds
# its machine's environment, then each phase its section; a phase's whole output goes to
# <phase>.log in the folder beside the report (the report's name without .md). When OUT is set (the
# device tool's folder, whose files come back: 8 at most), the report is copied there after every
# line and that folder, packed as one <folder>.tar.gz, after every phase and every anchor run, so
# that a call cut short still brings back all it did; a later call on a bare machine continues the
# report when ACCEPTANCE_REPORT names it and it was copied back into the tree.
# SPEEDRUN_PREBUILT=1: build/ was built elsewhere (same toolkit, same paths) and is used as it is:
# nothing is configured or built, so that a machine lent minutes at a time spends none compiling.
# Exit status: 0 every phase passed, 1 one failed, 2 usage, 77 none failed but some had no GPU.
# ANCHOR_RECORD names the record's train_gpt.py (default: ../shared's, else .carry/anchor's).
# ACCEPTANCE_TEST_TIMEOUT: seconds a test of `tests` may take (300; `slow`'s take up to 900) before
# ctest stops it and goes on, so that one hung kernel does not take the rest of a device call with it;
# ACCEPTANCE_BENCH_TIMEOUT the same for each bench_kernels run (300 s), and a trainer run of the
# anchor and profile phases ends after 120 s without progress (--stall-timeout 120).
# Usage: tools/acceptance.sh [build|tests|sanitize|slow|smoke|self-check|bench|anchor|profile|nccl]...
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

all_phases=(build tests sanitize slow smoke self-check bench anchor profile nccl)
phases=("$@")
((${#phases[@]})) || phases=("${all_phases[@]}")
for phase in "${phases[@]}"; do
  if [[ " ${all_phases[*]} " != *" $phase "* ]]; then
    echo "usage: $0 [$(IFS='|' && echo "${all_phases[*]}")]... (no argument: every phase)" >&2
    exit 2
  fi
done
read -ra anchor_runs <<<"${ANCHOR_RUNS:-8:20 1:60}"
for run in "${anchor_runs[@]:-none}"; do  # "none": a blank ANCHOR_RUNS is refused too
  if [[ ! $run =~ ^[1-9][0-9]*:[1-9][0-9]*$ ]]; then
    echo "error: ANCHOR_RUNS = '${ANCHOR_RUNS:-}': each run must be M:N (micro-sequences:steps), e.g. \"8:20 1:60\"" >&2
    exit 2
  fi
done

host=$(hostname -s 2>/dev/null || hostname)
report=${ACCEPTANCE_REPORT:-logs/acceptance-$host-$(date +%F).md}
logs=${report%.md}
mkdir -p "$(dirname "$report")" "$logs"
work=$(mktemp -d)
# run.sh builds the trainer unless it is told which to run.
# A build staged by tools/stage_build.sh (a carry of the device tool) goes where the phases look.
[[ -z ${SPEEDRUN_PREBUILT:-} ]] || tools/stage_build.sh unpack || exit 1
[[ -n ${SPEEDRUN_PREBUILT:-} ]] && export SPEEDRUN_TRAINER=$PWD/build/train_gpt
# The gpu tests' verdict is at their full shapes: only the sanitize phase asks for the CI-sized subset.
unset SPEEDRUN_TEST_SUBSET
trainer=${SPEEDRUN_TRAINER:-build/train_gpt}
baseline=.carry/baseline  # tools/stage_build.sh's SPEEDRUN_BASELINE: an earlier commit's trainer and bench
baseline_revision() { cut -c1-7 "$baseline/REVISION" 2>/dev/null || echo "(commit unknown)"; }
trap 'rm -rf "$work"' EXIT

# The GPUs this process may use: CUDA_VISIBLE_DEVICES's list when it is set, else all that
# nvidia-smi lists; none without a driver.
gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((gpu_count == 0)); then
  gpus=()
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
else
  mapfile -t gpus < <(seq 0 $((gpu_count - 1)))
fi

# The oracle's runs: the record's model and M = 8 micro-sequences of 4,096 tokens whatever W (the
# SUM convention makes W = 1 and W = N the same mathematics), 4 steps so that every parameter has
# been updated twice (qkv and c_fc get gradients from step 3, once the zero-initialised projections
# have moved), one seed on every rank, no warmup, validation kept small; the final checkpoint holds
# every parameter on every rank. A hung collective ends a run after 120 s.
oracle_steps=4
# The bundled sample in 4,096-token sequences (32 blocks, windows to 14), no warmup, no validation:
# the oracle's runs and the sanitizer's trainer runs.
sample_run_flags=(--seq-len 4096 --train-files "data/sample/sample_train_*.bin"
  --val-files "data/sample/sample_val_*.bin" --warmup-steps 0 --val-every 0 --val-tokens 32768 --val-seq-len 4096)
oracle_flags=("${sample_run_flags[@]}" --micro-batches 8 --num-iterations "$oracle_steps" --seed 1234
  --stall-timeout 120)
# How long two ranks started with different flags may take to stop (they are told at once; the
# guard ends a hang, after the oracle's --stall-timeout has had its say).
disagreeing_flags_timeout=${ACCEPTANCE_DISAGREEING_FLAGS_TIMEOUT:-150}
# Bounds on the worst relative error of a parameter, those of the GPU oracle (tests/gpu/test_distributed.cu).
fp32_bound=0.1 bf16_bound=0.5

# Appends lines to the report (and its copy in OUT).
say() {
  printf '%s\n' "$@" >>"$report"
  if [[ -n ${OUT:-} && ! $report -ef $OUT/$(basename "$report") ]]; then cp "$report" "$OUT/"; fi
}

# Packs the logs' folder into OUT (one file, however many runs and phases), replacing the last pack.
return_logs() {
  [[ -n ${OUT:-} ]] || return 0
  if tar -czf "$OUT/logs.tar.gz.part" -C "$(dirname "$logs")" "$(basename "$logs")"; then
    mv "$OUT/logs.tar.gz.part" "$OUT/$(basename "$logs").tar.gz"
  else
    rm -f "$OUT/logs.tar.gz.part"  # it would take one of the files that come back
  fi
}

# capture <file> <command...>: runs the command, its output into the file and the phase's log.
capture() {
  local file=$1
  shift
  "$@" 2>&1 | tee "$file" >>"$log"
  return "${PIPESTATUS[0]}"
}

# Why a phase that returns 77 was skipped (its verdict); a phase with another reason sets it.
skipped_because="no GPU"
need_gpu() {
  ((${#gpus[@]})) && return 0
  say "No GPU (nvidia-smi lists none): skipped."
  return 1
}

# build_targets <target...>: configures build/ when it is not, then builds the targets.
build_targets() {
  local start=$SECONDS generator=() target
  if [[ -n ${SPEEDRUN_PREBUILT:-} ]]; then
    for target in "$@"; do
      [[ $target == *_tests || -x build/$target || -x build/tests/$target || -f build/lib$target.so ]] && continue
      say "SPEEDRUN_PREBUILT: build/ has no $target."
      return 1
    done
    say "SPEEDRUN_PREBUILT: build/ used as it is ($* not rebuilt)."
    return 0
  fi
  if [[ ! -f build/CMakeCache.txt ]]; then
    command -v ninja >/dev/null && generator=(-G Ninja)
    if ! cmake --preset release "${generator[@]}" >>"$log" 2>&1; then
      say "Configuring build/ FAILED: the end of $phase.log says why."
      return 1
    fi
  fi
  if ! cmake --build build -j "$(nproc)" --target "$@" >>"$log" 2>&1; then
    say "Building $* FAILED: the end of $phase.log says why."
    return 1
  fi
  say "Built $* ($((SECONDS - start)) s)."
}

environment() {
  local line
  [[ -s $report ]] || say "# GPU machine acceptance (tools/acceptance.sh)"
  say "" "## Machine $host, $(date '+%F %T')" ""
  if ((gpu_count > 0)); then
    say "- GPUs (index, name, driver, memory):"
    while IFS= read -r line; do
      say "  - $line"
    done < <(nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader)
    say "- driver's $(nvidia-smi | grep -o 'CUDA Version: [0-9.]*'); CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-(unset)}"
  else
    say "- GPUs: none (nvidia-smi lists no GPU)"
  fi
  say "- nvcc: $(nvcc --version 2>/dev/null | grep -o 'release .*' || echo 'not found')"
  say "- $(cmake --version 2>/dev/null | head -1 || echo 'cmake not found'); $(uname -sr)"
  say "- source: $(git describe --always --dirty 2>/dev/null || echo 'not a git checkout')"
}

phase_build() {
  build_targets gpu_tests bench_kernels || return 1
  # What the trainer loads (cuBLASLt's and NCCL's versions are in the files' names).
  local libraries
  libraries=$(ldd build/train_gpt 2>/dev/null | awk '/cublas|nccl|cudart/ { print $3 }' | xargs -r realpath |
    xargs -r -n1 basename | paste -sd ' ')
  say "The trainer loads: ${libraries:-(ldd names none of cuBLAS, cuBLASLt, NCCL, cudart)}."
}

# ctest_phase <target> <ctest arguments...>: builds the target (those tests), runs them, and
# tables each test's result and time.
ctest_phase() {
  need_gpu || return 77
  build_targets "$1" || return 1
  shift
  # Verbose: every test's own lines (its errors and margins) go to the phase's log, passed ones too.
  capture "$work/ctest.txt" ctest --test-dir build "$@" --no-tests=error --verbose
  local status=$?
  # CTest's line of a finished test: "  3/12 Test  #3: <name> ....   Passed    0.81 sec" (or ***Failed)
  local finished='^ *[0-9]+/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*'
  say "" "| test | result | time |" "|---|---|---|"
  say "$(sed -nE "s@$finished(\*\*\*| +)(.*[^ ]) +([0-9.]+) sec\$@| \1 | \3 | \4 s |@p" "$work/ctest.txt")"
  say "" "$(grep -E '^[0-9]+% tests passed' "$work/ctest.txt" || echo "CTest gave no summary: see $phase.log.")"
  local failed_tests=() test
  while read -r test; do
    [[ -x build/tests/$test ]] && failed_tests+=("memcheck:$test")
  done < <(sed -nE "s@$finished\*\*\*(Failed|Timeout|Exception).*@\1@p" "$work/ctest.txt")
  ((${#failed_tests[@]} == 0)) ||
    say "" "The line that faults, if one does: \`SANITIZE_RUNS=\"${failed_tests[*]}\" tools/acceptance.sh sanitize\`."
  return "$status"
}

# compute-sanitizer: COMPUTE_SANITIZER where it is set, else on the PATH, else beside nvcc, else in
# CUDA's usual folder.
sanitizer_program() {
  local candidate
  if [[ -n ${COMPUTE_SANITIZER:-} ]]; then
    [[ -x $COMPUTE_SANITIZER ]] && echo "$COMPUTE_SANITIZER"
    return
  fi
  for candidate in "$(command -v compute-sanitizer)" "$(dirname "$(command -v nvcc || echo .)")/compute-sanitizer" \
    /usr/local/cuda/bin/compute-sanitizer; do
    [[ -x $candidate ]] && { echo "$candidate"; return 0; }
  done
  return 1
}

# tool:test[:case], case a name fragment the test's cases are selected by (tests/check.h; "-fragment"
# leaves those out): of gpu_device only its probes of TMA, mbarriers and setmaxnreg (of its other
# cases one needs two kernels at once, one fails a launch on purpose, the rest check the device and
# the libraries' loading). tool:train_gpt is the trainer itself, 2 steps on the bundled sample with
# its default paths (the kernels wired at the model's shapes, which the tests' own shapes are not),
# tool:train_gpt:opt-in with every opt-in fast path. The hand-written Hopper kernels first, so
# that a budget cut leaves out the kernels that have run on a GPU before.
default_sanitize_runs=(memcheck:test_attention memcheck:test_kernels synccheck:test_attention synccheck:test_kernels
  racecheck:test_attention racecheck:test_kernels memcheck:train_gpt memcheck:train_gpt:opt-in
  memcheck:gpu_device:setmaxnreg synccheck:gpu_device:setmaxnreg memcheck:test_residual memcheck:test_fp8_head
  memcheck:test_muon)
sanitized_trainer_flags=(--num-iterations 2 --micro-batches 1 "${sample_run_flags[@]}" --self-check off)
opt_in_paths=(--attention flash-ws --mlp-fc fused --qkv fused --qkv-backward fused --launch-overlap pdl)

# sanitizer_finding <log>: the first error compute-sanitizer reported (a line of its own, the details
# indented below it), with its first detail that says where ("at <kernel>+<offset> in <file>:<line>",
# or a hazard's "<access> Thread (...) at ... in ..."), as one cell of a table.
sanitizer_finding() {
  awk '/^========= [^ ]/ && !/COMPUTE-SANITIZER|SUMMARY|Target application returned/ { if (what) exit; what = $0; next }
       what && / at .* in / { where = $0; exit }
       END { gsub(/^=+ +/, "", what); gsub(/^=+ +/, "", where); print what (where ? "; " where : "") }' "$1" |
    sed 's/|/\\|/g'
}

phase_sanitize() {
  need_gpu || return 77
  local sanitizer runs run tool test cases name tests=() dir=$logs/sanitize failed=0 status errors result started=$SECONDS
  local budget=${ACCEPTANCE_SANITIZE_BUDGET:-420} limit=${ACCEPTANCE_SANITIZE_TIMEOUT:-120}
  runs=("${default_sanitize_runs[@]}")
  [[ ! -v SANITIZE_RUNS ]] || read -ra runs <<<"$SANITIZE_RUNS"
  for run in "${runs[@]:-none}"; do  # "none": a blank SANITIZE_RUNS is refused too
    if [[ ! $run =~ ^(memcheck|racecheck|synccheck|initcheck):([A-Za-z0-9_]+)(:[A-Za-z0-9_.-]+)?$ ||
      ($run == *:train_gpt:* && $run != *:train_gpt:opt-in) ]]; then
      say "SANITIZE_RUNS: '$run' is not tool:test, tool:test:case, tool:train_gpt or tool:train_gpt:opt-in \
(tool: memcheck, racecheck, synccheck or initcheck)."
      return 1
    fi
    [[ " ${tests[*]} " == *" ${BASH_REMATCH[2]} "* ]] || tests+=("${BASH_REMATCH[2]}")
  done
  if ! sanitizer=$(sanitizer_program); then
    say "No compute-sanitizer (${COMPUTE_SANITIZER:-not on the PATH, nor beside nvcc, nor in /usr/local/cuda/bin}): nothing checked."
    skipped_because="no compute-sanitizer"
    return 77
  fi
  build_targets "${tests[@]}" || return 1
  mkdir -p "$dir"
  say "" "compute-sanitizer: $sanitizer; the tests at the CI-sized shapes (SPEEDRUN_TEST_SUBSET=1)." "" \
    "| test | tool | result | first finding |" "|---|---|---|---|"
  for run in "${runs[@]}"; do
    IFS=: read -r tool test cases <<<"$run"
    name=$test${cases:+ ($cases)}
    if ((SECONDS - started >= budget)); then
      say "| $name | $tool | not run: the phase spent its ACCEPTANCE_SANITIZE_BUDGET=$budget s | |"
      failed=1
      continue
    fi
    local extra=() command_line begun=$SECONDS file=$dir/$test${cases:+_$cases}_$tool
    local found=$file.txt
    [[ $tool == racecheck ]] && extra=(--racecheck-report hazard)
    if [[ $test == train_gpt ]]; then
      command_line=("$trainer" "${sanitized_trainer_flags[@]}" --log-dir "$file.logs" \
        --checkpoint-dir "$work/checkpoints_${file##*/}")
      [[ -z $cases ]] || command_line+=("${opt_in_paths[@]}")
    else
      command_line=("build/tests/$test" ${cases:+"$cases"})
    fi
    rm -f "$found"  # an earlier call's, the same day on this machine: never read as this run's
    # --report-api-errors no: a CUDA call that returns an error the program handles (a library probing
    # the driver) is not a finding; our own calls' errors fail the test itself
    capture "$file.out" env SPEEDRUN_TEST_SUBSET=1 timeout -k 10 "$limit" "$sanitizer" --tool "$tool" \
      --report-api-errors no --print-limit 20 --log-file "$found" "${extra[@]}" "${command_line[@]}"
    status=$?
    # memcheck, synccheck, initcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards
    # displayed (E errors, W warnings)"
    errors=$(sed -nE -e 's/^========= ERROR SUMMARY: ([0-9]+) errors?$/\1/p' \
      -e 's/^========= RACECHECK SUMMARY: .*\(([0-9]+) errors?, .*$/\1/p' "$found" 2>/dev/null | tail -1)
    # before it opens its log file, compute-sanitizer says on its own output what stops it
    [[ -s $found ]] || cp "$file.out" "$found"
    if grep -qs 'Device not supported' "$found"; then
      say "| $name | $tool | not run: compute-sanitizer does not support this machine's GPU | $(sanitizer_finding "$found") |"
      ((failed)) && return 1  # the runs before it found something
      skipped_because="compute-sanitizer cannot use this GPU"
      return 77
    elif ((status == 124 || status == 137)); then
      result="FAILED: still running after ACCEPTANCE_SANITIZE_TIMEOUT=$limit s"
    elif [[ -z $errors ]]; then
      result="FAILED: no summary from compute-sanitizer (exit $status)"
    elif ((errors > 0)); then
      result="FAILED: $errors errors"
    elif ((status != 0)); then
      result="FAILED: the test failed (exit $status), no sanitizer errors"
    else
      result="clean ($((SECONDS - begun)) s)"
    fi
    [[ $result == clean* ]] || failed=1
    say "| $name | $tool | $result | $(sanitizer_finding "$found") |"
  done
  say "" "Each run's sanitizer report: sanitize/<test>[_<case>]_<tool>.txt beside $phase.log; the program's own \
lines: .out."
  return "$failed"
}

phase_smoke() {
  need_gpu || return 77
  build_targets train_gpt || return 1
  capture "$work/smoke.txt" bash tests/gpu/smoke_run.sh build/train_gpt
  local status=$?
  say "" "$(grep -E '^(validation losses|the trainer reports|smoke run passed|FAILED)' "$work/smoke.txt" | sed 's/^/- /')"
  return "$status"
}

phase_self_check() {
  need_gpu || return 77
  build_targets train_gpt || return 1
  local gpu status failed=0 out summary summaries=()
  say "" "| GPU | check | rel. error | bound | verdict |" "|---|---|---|---|---|"
  for gpu in "${gpus[@]}"; do
    out=$work/self_check_$gpu.txt
    capture "$out" env CUDA_VISIBLE_DEVICES="$gpu" NPROC=1 ./run.sh --self-check strict --self-check-only \
      --log-dir "$work/logs" --checkpoint-dir "$work/checkpoints"
    status=$?
    if grep -q '^error: unknown flag --self-check' "$out"; then
      say "" "MISSING: this trainer has no --self-check (\`error: unknown flag\`), the start-up self-check" \
        "of issue 19: nothing was checked."
      return 1
    fi
    # a check with its error, or one that failed without one (it threw, hung or stopped the GPU: its
    # process's end, kernels/self_check_process.cuh)
    say "$(sed -nE -e "s/^self-check ([^:]+): rel\. error ([^ ]+) \(bound ([^)]+)\) (.*)$/| $gpu | \1 | \2 | \3 | \4 |/p" \
      -e "s/^self-check ([^:]+): (.*) FAILED$/| $gpu | \1 | - | - | FAILED: \2 |/p" "$out")"
    summary=$(grep -m1 '^self-check: ' "$out")
    case $status in
      0) [[ -n $summary ]] || { summary="exit 0 but no self-check summary line"; failed=1; } ;;
      6) failed=1 ;;
      *) summary="${summary:+$summary; }the self-check did not finish: exit $status (self-check.log)"; failed=1 ;;
    esac
    summaries+=("- GPU $gpu: $summary")
  done
  say "" "${summaries[@]}"
  ((failed == 0)) ||
    say "" "The line that faults, if one does: \`tools/acceptance.sh sanitize\` (the kernels' tests and the trainer \
with every fast path under compute-sanitizer)."
  return "$failed"
}

# With one GPU the nccl phase's ranks share it (--ranks-share-gpu: NCCL over loopback sockets).
share_flags=()

# ranks_run <W> <output file> <flags...>: the trainer over W NCCL ranks (one, W = 1: no NCCL).
ranks_run() {
  local W=$1 file=$2 share=()
  shift 2
  ((W > 1)) && share=("${share_flags[@]}")
  capture "$file" env NPROC="$W" ./run.sh "${oracle_flags[@]}" "${share[@]}" "$@" --log-dir "$work/logs"
}

# oracle_run <W> <grad-comm> <checkpoint folder>
oracle_run() {
  ranks_run "$1" "$work/oracle_run.txt" --grad-comm "$2" --checkpoint-dir "$3"
}

phase_nccl() {
  need_gpu || return 77
  local n=${#gpus[@]} worlds=() W mode dir status start failed=0 bound result
  build_targets train_gpt || return 1
  if ((n < 2)); then
    share_flags=(--ranks-share-gpu)
    worlds=(2 4)
    say "One GPU: W ranks share it (\`--ranks-share-gpu\`: each rank its own NCCL_HOSTID, NCCL's socket" \
      "transport over the loopback). Real NCCL calls, groups and splits; NVLink is not exercised." ""
  else
    for W in 2 4 "$n"; do
      if ((W <= n)) && [[ " ${worlds[*]} " != *" $W "* ]]; then worlds+=("$W"); fi
    done
  fi
  start=$SECONDS
  oracle_run 1 fp32-rs "$work/oracle_W1"
  status=$?
  if ((status != 0)); then
    say "The W = 1 run FAILED (exit $status): nothing to compare with (nccl.log)."
    return 1
  fi
  local reference=("$work"/oracle_W1/step_*.ckpt)
  say "The trainer for $oracle_steps steps (\`${oracle_flags[*]}\`), checkpoints compared with W = 1's" \
    "(fp32-rs, one process, $((SECONDS - start)) s): the worst relative error of any parameter on any rank." \
    "" "| grad-comm | W | worst relative error (parameter, rank) | bound | verdict | time |" "|---|---|---|---|---|---|"
  for W in "${worlds[@]}"; do
    for mode in fp32-rs bf16-rs a2a-fp32acc; do
      start=$SECONDS
      dir=$work/oracle_${mode}_W$W
      bound=$bf16_bound
      [[ $mode == fp32-rs ]] && bound=$fp32_bound
      if oracle_run "$W" "$mode" "$dir"; then
        capture "$work/compare.txt" python3 tools/compare_checkpoints.py --bound "$bound" "${reference[0]}" \
          "$dir"/rank*/step_*.ckpt
        status=$?
        result=$(tail -1 "$work/compare.txt" | sed -E "s#^worst relative error ([^ ]+) \(([^,]+), $dir/(rank[0-9]+)/.*\), bound .*: (ok|FAILED)\$#\1 (\2, \3) | $bound | \4#")
        ((status == 0)) || failed=1
        ((status == 0 || status == 1)) || result="the comparison failed (exit $status): $(tail -1 "$work/compare.txt") | $bound | FAILED"
      else
        status=$?
        result="the run FAILED (exit $status: $(grep -m1 '^error' "$work/oracle_run.txt")) | $bound | FAILED"
        failed=1
      fi
      say "| $mode | $W | $result | $((SECONDS - start)) s |"
      rm -rf "$dir"
    done
  done
  phase_nccl_diloco || failed=1
  phase_nccl_disagreeing_flags || failed=1
  return "$failed"
}

# Ranks started with different flags must stop at once and say so, before any collective whose
# calls depend on a flag: rank 0 with 2 DiLoCo groups (whose communicator split is such a
# collective), rank 1 with one. Each rank is its own run.sh, started as a launcher would start it.
phase_nccl_disagreeing_flags() {
  local out=$work/disagreeing_flags_rank port=$((20000 + RANDOM % 20000)) start=$SECONDS rank pids=() statuses=()
  local groups=(2 1) verdict=ok
  say "" "Ranks started with different flags (rank 0 \`--diloco-groups 2\`, rank 1 one group): both must stop" \
    "with \"the ranks were started with different flags\" within $disagreeing_flags_timeout s." ""
  for rank in 0 1; do
    WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$rank LOCAL_RANK=$rank \
      timeout -k 10 "$disagreeing_flags_timeout" ./run.sh "${oracle_flags[@]}" "${share_flags[@]}" \
      --diloco-groups "${groups[rank]}" --log-dir "$work/logs" --checkpoint-dir "$work/disagreeing_flags" \
      >"$out$rank.txt" 2>&1 &
    pids+=($!)
  done
  for rank in 0 1; do
    wait "${pids[rank]}"
    statuses+=($?)
    cat "$out$rank.txt" >>"$log"
  done
  for rank in 1 0; do  # rank 0's reason last, so that it is the one said
    if ((statuses[rank] == 124 || statuses[rank] == 137)); then
      verdict="FAILED (rank $rank still running after $disagreeing_flags_timeout s: hung)"
    elif ((statuses[rank] == 0)) || ! grep -q "the ranks were started with different flags" "$out$rank.txt"; then
      verdict="FAILED (rank $rank exit ${statuses[rank]}: $(grep -m1 '^error' "$out$rank.txt" || echo 'no error line'))"
    fi
  done
  say "Verdict: $verdict (exits ${statuses[*]}, $((SECONDS - start)) s)."
  rm -rf "$work/disagreeing_flags"
  [[ $verdict == ok ]]
}

# Streaming DiLoCo over NCCL ranks, 2 groups: each fragment's exchange starts a step before it is
# applied, the last one still in flight at the end; the trainer's own checksums over every rank
# after the final sync fail the run if the groups do not hold one model.
phase_nccl_diloco() {
  local W out status syncs failed=0 start
  say "" "Streaming DiLoCo (\`--diloco-groups 2 --diloco-fragments 2 --diloco-sync-every 4 --diloco-sync-delay 1\`," \
    "the same $oracle_steps steps): every rank must hold the same parameters after the final sync." "" \
    "| W | groups of | syncs logged | verdict | time |" "|---|---|---|---|---|"
  for W in 2 4; do
    ((W <= ${#gpus[@]} || ${#share_flags[@]})) || continue
    start=$SECONDS
    out=$work/diloco_W$W.txt
    ranks_run "$W" "$out" --diloco-groups 2 --diloco-fragments 2 --diloco-sync-every 4 --diloco-sync-delay 1 \
      --checkpoint-dir "$work/diloco_W$W"
    status=$?
    syncs=$(grep -c '^diloco: fragment' "$out")
    if ((status == 0 && syncs > 0)); then
      say "| $W | $((W / 2)) | $syncs | ok | $((SECONDS - start)) s |"
    else
      say "| $W | $((W / 2)) | $syncs | FAILED (exit $status: $(grep -m1 '^error' "$out")) | $((SECONDS - start)) s |"
      failed=1
    fi
    rm -rf "$work/diloco_W$W"
  done
  return "$failed"
}

# The offline corpus (FineWeb's format) of the anchor and profile phases: corpus-bin/, unpacked from
# .carry/corpus/ when it is not there yet.
corpus_flags=(--train-files "corpus-bin/corpus_train_*.bin" --val-files "corpus-bin/corpus_val_*.bin")
need_corpus() {
  compgen -G "corpus-bin/corpus_train_*.bin" >/dev/null && return 0
  [[ -d .carry/corpus ]] && tools/corpus_run.sh unpack >>"$log" 2>&1 && return 0
  say "No corpus: corpus-bin/ is empty and .carry/corpus/ did not unpack (stage it with tools/corpus_run.sh" \
    "stage on a machine that has ../shared)."
  return 1
}

# The record's train_gpt.py: ANCHOR_RECORD, else ../shared's, else the copy staged in .carry/anchor/.
anchor_record() {
  local f
  for f in "${ANCHOR_RECORD:-}" ../shared/anchor/record25/train_gpt.py .carry/anchor/train_gpt.py; do
    [[ -n $f && -f $f ]] && { echo "$f"; return 0; }
  done
  say "No record code: neither ANCHOR_RECORD, ../shared/anchor/record25/train_gpt.py nor" \
    ".carry/anchor/train_gpt.py (tools/corpus_run.sh stage) is a file."
  return 1
}

# run_program <ours|record> <M> <N> <folder> [more flags...]: the trainer or the record's code for N
# steps of M micro-sequences on the corpus, its log into the folder; the record's code with each
# step line synchronised (as the trainer's are) and no validation.
run_program() {
  local who=$1 M=$2 N=$3 dir=$4 program=$trainer
  shift 4
  mkdir -p "$dir"
  [[ $who == baseline ]] && program=$baseline/train_gpt
  if [[ $who == ours || $who == baseline ]]; then
    # --stall-timeout: a kernel that hangs in a step ends the run in 2 minutes, not the call in 10
    capture "$dir/console.txt" "$program" "${corpus_flags[@]}" --micro-batches "$M" --num-iterations "$N" \
      --val-every 0 --val-tokens 262144 --warmup-steps 3 --seed 1 --stall-timeout 120 --log-dir "$dir" \
      --checkpoint-dir "$work/checkpoints_$who" "$@"
  else
    capture "$dir/console.txt" python3 tools/record_pytorch.py --record "$record" "${corpus_flags[@]}" \
      --micro-batches "$M" --num-iterations "$N" --sync-steps --no-validation --log-dir "$dir" "$@"
  fi
}

# run_log <folder>: the run's log in the folder run_program gave it (any .txt but its console's).
run_log() {
  local f
  for f in "$1"/*.txt; do
    [[ $f == */console.txt ]] || { echo "$f"; return 0; }
  done
}

# step_times_ms <log> <from> [to]: the step lines' train_time at step <from> and at step <to> (the
# last when not given) and the mean step between them, "T_from T_to mean"; nothing when the log
# has not both.
step_times_ms() {
  grep -E '^step:[0-9]+/[0-9]+ train_time:[0-9.]+ms' "$1" |
    sed -E 's#^step:([0-9]+)/[0-9]+ train_time:([0-9.]+)ms.*#\1 \2#' |
    awk -v from="$2" -v to="${3:-0}" '$1 == from { t0 = $2 } (to == 0 || $1 <= to) { s = $1; t = $2 }
      END { if (t0 != "" && s > from) printf "%s %s %.1f", t0, t, (t - t0) / (s - from) }'
}

anchor_skip=2  # timed steps left out of the mean besides each program's untimed warm-up

# anchor_run <who> <M> <N> <folder> [flags...]: runs the program (run_program) and prints its
# table cell: the mean step, or FAILED and why (status 1).
anchor_run() {
  local dir=$4 status times
  run_program "$@"
  status=$?
  return_logs
  times=$(step_times_ms "$(run_log "$dir")" "$anchor_skip")
  if ((status != 0)) || [[ -z $times ]]; then
    echo "FAILED: exit $status$([[ -n $times ]] || echo ", no step lines") (${dir#"$logs"/}/console.txt)"
    return 1
  fi
  echo "${times##* }"
}

# fallback_note <folder>: " (self-check fell back: <paths>)" where the trainer's run in the folder
# replaced fast paths by their references at start-up (its steps then timed other kernels than its
# flags name), else nothing.
fallback_note() {
  local paths
  paths=$(sed -nE 's/^(WARNING: )?self-check fallback: (.*) failed (here|on another rank).*/\2/p' "$1/console.txt" \
    2>/dev/null | sort -u | paste -sd';' -)
  [[ -z $paths ]] || echo " (self-check fell back: ${paths//;/; })"
}

# loss_agreement <console> <console> <N>: whether two runs of the trainer of N steps printed the same
# loss at every step (seeded alike, a variant that changes no arithmetic, e.g. --launch-overlap pdl
# or --attention flash-ws, must), or the first step where they differ; where one stopped early, at
# how many of the N both printed.
loss_agreement() {
  awk -v steps="$3" '/^step:[0-9]+\/[0-9]+ .* loss:/ {
         split($1, s, "[:/]"); for (i = 1; i <= NF; ++i) if ($i ~ /^loss:/) v = substr($i, 6)
         if (FILENAME == ARGV[1]) { a[s[2]] = v; next }
         if (s[2] in a) { ++n; if (a[s[2]] != v && d == "") d = "step " s[2] ": " a[s[2]] " against " v }
       }
       END { if (d != "") print "differ from " d
             else if (!n) print "no step lines to compare"
             else if (n < steps) print "the same at the " n " of " steps " steps both printed (a run stopped early)"
             else print "the same at all " n " steps" }' "$1" "$2"
}

phase_anchor() {
  need_gpu || return 77
  build_targets train_gpt || return 1
  need_corpus || return 1
  record=$(anchor_record) || return 1
  local run M N who start mean means failed=0 rows=() variant variants=() flags label against=() agreements=() dir agreement fastest
  IFS=';' read -ra variants <<<"${ANCHOR_VARIANTS:-}"
  say "" "The trainer and record #25's own code (\`$record\`, run by tools/record_pytorch.py: M batches of its" \
    "own loader per step, each \`(loss / M).backward()\`, its step lines synchronised as the trainer's are, no" \
    "validation) on this GPU, one after the other, the trainer first; each over the window schedule of its N steps" \
    "(the record's formula). Mean step: the step lines' train_time from step $anchor_skip to N, over the steps" \
    "between (both programs' warm-ups are untimed; their first $anchor_skip timed steps are left out too)." "" \
    "| run | steps | wall s (start-up, compile, warm-up included) | mean step ms | losses against ours (the same seed) |" \
    "|---|---|---|---|---|"
  for run in "${anchor_runs[@]}"; do
    M=${run%:*} N=${run#*:} means=()
    for who in ours record; do
      start=$SECONDS
      mean=$(anchor_run "$who" "$M" "$N" "$logs/anchor/${who}_M$M") || failed=1
      say "| $who, M = $M$(fallback_note "$logs/anchor/${who}_M$M") | $N | $((SECONDS - start)) | $mean | |"
      means+=("$([[ $mean == FAILED* ]] || echo "$mean")")
    done
    label="M = $M$(fallback_note "$logs/anchor/ours_M$M")"
    if [[ -n ${means[0]} && -n ${means[1]} ]]; then
      rows+=("| $label | ${means[0]} | ${means[1]} | $(awk -v a="${means[0]}" -v b="${means[1]}" 'BEGIN { printf "%.3f", a / b }') |")
    else
      rows+=("| $label | ${means[0]:-failed} | ${means[1]:-failed} | - |")
    fi
    for variant in "${variants[@]}"; do
      if [[ $variant == *@bench* ]]; then
        if { [[ $variant == *@bench-fp8* ]] && ! fp8=$(bench_value fp8-logits-algorithm); } ||
          { [[ ${variant//@bench-fp8/} == *@bench* ]] && ! fastest=$(bench_value matmul-algorithms); }; then
          say "| ours $variant, M = $M | $N | 0 | not run: no bench value for @bench (no bench phase on this machine, nor its line in the report) | |"
          failed=1
          continue
        fi
        variant=${variant//@bench-fp8/${fp8:-}}
        variant=${variant//@bench/${fastest:-}}
      fi
      read -ra flags <<<"$variant"
      ((${#flags[@]})) || continue
      label="ours ${flags[*]}" start=$SECONDS
      dir=$logs/anchor/ours_M${M}_$(echo "${flags[*]}" | tr -c 'A-Za-z0-9\n' _)
      mean=$(anchor_run ours "$M" "$N" "$dir" "${flags[@]}") || failed=1
      label+=$(fallback_note "$dir")
      agreement=$(loss_agreement "$logs/anchor/ours_M$M/console.txt" "$dir/console.txt" "$N")
      say "| $label, M = $M | $N | $((SECONDS - start)) | $mean | $agreement |"
      agreements+=("- M = $M, $label: $agreement")
      if [[ $mean != FAILED* && -n ${means[1]} ]]; then
        rows+=("| M = $M, $label | $mean | ${means[1]} | $(awk -v a="$mean" -v b="${means[1]}" 'BEGIN { printf "%.3f", a / b }') |")
      fi
    done
    [[ -x $baseline/train_gpt ]] || continue
    label="baseline $(baseline_revision)" start=$SECONDS
    mean=$(anchor_run baseline "$M" "$N" "$logs/anchor/baseline_M$M") || failed=1
    label+=$(fallback_note "$logs/anchor/baseline_M$M")
    say "| $label, M = $M | $N | $((SECONDS - start)) | $mean | |"
    [[ $mean == FAILED* ]] && continue
    [[ -n ${means[1]} ]] &&
      rows+=("| M = $M, $label | $mean | ${means[1]} | $(awk -v a="$mean" -v b="${means[1]}" 'BEGIN { printf "%.3f", a / b }') |")
    [[ -n ${means[0]} ]] &&
      against+=("| M = $M | ${means[0]} | $mean | $(awk -v a="${means[0]}" -v b="$mean" 'BEGIN { printf "%.3f", a / b }') |")
  done
  say "" "Side by side on $(nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader |
    head -1 | cut -d, -f2 | sed 's/^ *//'), $(date +%F) (mean step," \
    "warm-up excluded; below 1: the trainer is faster):" "" "| M | ours ms | record code ms | ours / record |" \
    "|---|---|---|---|" "${rows[@]}"
  ((${#agreements[@]})) && say "" "Each variant's printed losses against the trainer's own run (the same seed):" "" \
    "${agreements[@]}"
  ((${#against[@]})) && say "" "The trainer before and after: beside the baseline $(baseline_revision) (below 1: faster now):" "" \
    "| M | ours ms | baseline ms | ours / baseline |" "|---|---|---|---|" "${against[@]}"
  return "$failed"
}

# ncu_counters <folder>: the hardware counters of step 5's attention and cross-entropy
# kernels, where ncu runs and reads counters: the first 40 launches of them, the first micro-
# sequence's (11 attention layers forward, 6 head chunks, then the attention backward).
ncu_counters() {
  local dir=$1 status
  if ! command -v ncu >/dev/null; then
    say "" "ncu is not on this machine: no hardware counters."
    return 0
  fi
  capture "$dir/ncu_console.txt" timeout 300 ncu --clock-control none --profile-from-start off \
    --kernel-name-base demangled -k 'regex:flash::|softcap_cross_entropy' --launch-count 40 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --csv --page raw \
    "$trainer" "${corpus_flags[@]}" --micro-batches 8 --num-iterations 6 --val-every 0 --val-tokens 262144 \
    --warmup-steps 3 --seed 1 --profile-step 5 --self-check off --log-dir "$dir/ncu_logs" \
    --checkpoint-dir "$work/checkpoints_ncu"
  status=$?
  grep '^"' "$dir/ncu_console.txt" >"$dir/ncu_raw.csv"
  say "" "### Hardware counters of the trainer's attention and cross-entropy kernels (ncu, step 5, first 40 launches)" ""
  if ((status == 0)) && python3 tools/profile_summary.py --ncu "$dir/ncu_raw.csv" >"$dir/ncu.md" 2>&1; then
    say "$(cat "$dir/ncu.md")"
  else
    say "ncu gave no counters (exit $status): $(grep -m2 -E '==ERROR==|error' "$dir/ncu_console.txt" | paste -sd ' ')"
  fi
}

phase_profile() {
  need_gpu || return 77
  build_targets train_gpt kernel_profile || return 1
  need_corpus || return 1
  record=$(anchor_record) || return 1
  local who dir status times failed=0 library=$PWD/build/libkernel_profile.so
  say "" "Step 5 of 6 at M = 8 on the corpus, inside cudaProfilerStart/Stop (\`--profile-step 5\`), every kernel" \
    "timed by CUPTI (build/libkernel_profile.so, tools/profile_summary.py): the trainer, then the record's code."
  for who in ours record; do
    dir=$logs/profile/$who
    mkdir -p "$dir"
    CUDA_INJECTION64_PATH=$library KERNEL_PROFILE_OUT=$dir/kernels.csv run_program "$who" 8 6 "$dir" --profile-step 5
    status=$?
    times=$(step_times_ms "$(run_log "$dir")" 4 5)
    if [[ -n $times ]]; then
      say "" "### $who: step 5's own line: ${times##* } ms" ""
    else
      say "" "### $who: step 5's own line: none (exit $status)" ""
    fi
    if python3 tools/profile_summary.py "$dir/kernels.csv" >"$dir/kernels.md" 2>&1; then
      say "$(cat "$dir/kernels.md")"
    else
      say "No profile: $(tail -1 "$dir/kernels.md") (exit $status; profile/$who/console.txt)"
      failed=1
    fi
  done
  ncu_counters "$logs/profile/ours"
  return "$failed"
}

phase_bench() {
  need_gpu || return 77
  build_targets bench_kernels || return 1
  # The cuDNN rows load libcudnn.so.9: the system's, else the copy PyTorch's wheels bring.
  local cudnn_dir
  if ! ldconfig -p 2> /dev/null | grep -q 'libcudnn\.so\.9 ' &&
    cudnn_dir=$(python3 -c 'import nvidia.cudnn as m; print(list(m.__path__)[0] + "/lib")' 2> /dev/null); then
    export LD_LIBRARY_PATH=$cudnn_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  # A kernel that hangs (a never-run one, an mbarrier phase that never comes) ends the bench, not the call.
  capture "$work/bench_kernels.txt" timeout "${ACCEPTANCE_BENCH_TIMEOUT:-300}" build/bench_kernels 20
  local status=$?
  # the values of the anchor's "@bench" and "@bench-fp8": in build/, which stays between calls on one machine
  bench_flag_value "$work/bench_kernels.txt" matmul-algorithms >build/bench_matmul-algorithms.txt
  bench_flag_value "$work/bench_kernels.txt" fp8-logits-algorithm >build/bench_fp8-logits-algorithm.txt
  say "" "### Our kernels (\`build/bench_kernels 20\`)" "" "$(grep -v '^error' "$work/bench_kernels.txt")"
  ((status == 0)) || {
    say "" "bench_kernels FAILED (exit $status$( ((status == 124)) && echo ": still running after ACCEPTANCE_BENCH_TIMEOUT=${ACCEPTANCE_BENCH_TIMEOUT:-300} s, its last row above")).";
    return 1
  }
  capture "$work/bench_torch.txt" python3 tools/bench_torch.py --ours "$work/bench_kernels.txt"
  status=$?
  say "" "### Beside PyTorch (\`tools/bench_torch.py\`; ours / torch below 1: ours is faster)" ""
  say "$(grep -m1 -E '^[^|].*PyTorch' "$work/bench_torch.txt")" "" "$(grep '^|' "$work/bench_torch.txt")"
  ((status == 0)) || say "" "bench_torch.py FAILED (exit $status): $(tail -1 "$work/bench_torch.txt")"
  [[ -x $baseline/bench_kernels ]] || return "$status"
  capture "$work/bench_baseline.txt" timeout "${ACCEPTANCE_BENCH_TIMEOUT:-300}" "$baseline/bench_kernels" 20 || status=1
  say "" "### Beside the baseline $(baseline_revision) (its \`bench_kernels 20\`, the same call; the rows both name" \
    "once; now / baseline below 1: faster now)" "" "| row | now ms | baseline ms | now / baseline |" "|---|---|---|---|" \
    "$(paired_bench_rows "$work/bench_kernels.txt" "$work/bench_baseline.txt")"
  return "$status"
}

# bench_flag_value <file> <flag>: the last value of --<flag> on bench_kernels' lines of the fastest
# candidates' flags in the file (matmul-algorithms, fp8-logits-algorithm).
bench_flag_value() {
  sed -nE "s/^\| [^|]*the fastest candidates?'s? flag +\| --$2 ([^ |]+) \|$/\1/p" "$1" | tail -1
}

# What "@bench" (--matmul-algorithms) or "@bench-fp8" (--fp8-logits-algorithm) in an anchor variant
# stands for: the bench phase's value of <flag>, from this machine's earlier call (build/) or from
# the report; nothing (status 1) where neither has one.
bench_value() {
  local value
  value=$(cat "build/bench_$1.txt" 2>/dev/null)
  [[ -n $value ]] || value=$(bench_flag_value "$report" "$1")
  [[ -n $value ]] && echo "$value"
}

# The rows of bench_kernels' tables `now` and `before` that each names once (a repeated name, such as
# "its fastest: candidate 1", is no one row), in now's order: | row | now ms | before ms | ratio |.
paired_bench_rows() {
  awk -F'|' 'function trim(s) { gsub(/^ +| +$/, "", s); return s }
    NF >= 4 && trim($3) ~ /^[0-9.]+$/ { name = trim($2); seen[FILENAME, name]++; ms[FILENAME, name] = trim($3)
                                        if (FILENAME == now && seen[now, name] == 1) order[++rows] = name }
    END { for (i = 1; i <= rows; ++i) { name = order[i]
            if (seen[now, name] == 1 && seen[before, name] == 1 && ms[before, name] > 0)
              printf "| %s | %s | %s | %.3f |\n", name, ms[now, name], ms[before, name], ms[now, name] / ms[before, name] } }' \
    now="$1" before="$2" "$1" "$2"
}

environment
results=() worst=0
for phase in "${phases[@]}"; do
  log=$logs/$phase.log
  : >"$log"
  start=$SECONDS skipped_because="no GPU"
  echo "== $phase"
  say "" "## $phase" "" "Started $(date '+%T'); its whole output: $phase.log."
  case $phase in
    build) phase_build ;;
    tests) ctest_phase gpu_tests -L gpu -LE slow -E '^smoke_run$' -j 4 --timeout "${ACCEPTANCE_TEST_TIMEOUT:-300}" ;;
    sanitize) phase_sanitize ;;
    slow) ctest_phase slow_gpu_tests -L slow -j 3 --timeout 900 ;;
    smoke) phase_smoke ;;
    self-check) phase_self_check ;;
    bench) phase_bench ;;
    anchor) phase_anchor ;;
    profile) phase_profile ;;
    nccl) phase_nccl ;;
  esac
  status=$?
  case $status in
    0) verdict=passed ;;
    77) verdict="$skipped_because: skipped" ;;
    *) verdict=FAILED ;;
  esac
  say "" "**$phase: $verdict** ($((SECONDS - start)) s)"
  return_logs
  results+=("| $phase | $verdict | $((SECONDS - start)) s |")
  echo "$phase: $verdict"
  if [[ $verdict == FAILED ]]; then
    tail -n 30 "$log"
    worst=1
  elif ((status == 77 && worst == 0)); then
    worst=77
  fi
done
printf '\n| phase | result | time |\n|---|---|---|\n'
printf '%s\n' "${results[@]}"
echo "report: $report; the phases' output: $logs/"
if ((worst == 1)); then
  echo "Something failed: send $report and the failed phases' .log files from $logs/ (README: A new GPU machine)."
fi
exit $worst
