"""tools/acceptance.sh without a GPU: phase selection, the report's sections and tables, each phase's
verdict and the exit status, the oracle's runs over NCCL ranks and their comparison (the real
tools/compare_checkpoints.py). The script runs in a copy of the repository's layout in which the
GPU machine's commands are stand-ins: nvidia-smi, nvcc, cmake, ctest and ncu on PATH; run.sh (the
trainer's self-check and the oracle's runs, writing checkpoints), the smoke run, the benchmarks, the
trainer and the record's code (their step lines and, profiled, kernel_profile's file) for the anchor
and profile phases, summed by the real tools/profile_summary.py.
Exits 77 (skipped) without numpy, which the comparison needs."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import unittest

try:
    import numpy  # noqa: F401
except ImportError:
    print("numpy is missing (tools/compare_checkpoints.py needs it): skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "tools", "acceptance.sh")

# The trainer and the record's code for the anchor and profile phases: step lines of STEP_MS each
# into the log folder (the trainer's --log-dir, the record's too) and on the console with a loss
# that the last --seed given shifts (--fake-stop K: it dies after step K, exit 3); profiled (CUDA_INJECTION64_PATH and --profile-step),
# kernel_profile's file: the step's range and three kernels.
PROGRAM = """\
    import os, sys
    args = sys.argv[1:]
    flag = lambda name: args[args.index(name) + 1]
    M, N, folder = int(flag("--micro-batches")), int(flag("--num-iterations")), flag("--log-dir")
    with open(os.environ["FAKE_CALLS"] + ".programs", "a") as calls:
        calls.write(os.path.basename(sys.argv[0]) + " " + " ".join(args) + "\\n")
    step_ms = STEP_MS
    if "--fake-fallback" in args:  # the start-up self-check replaced the newest flash kernels
        line = ("self-check fallback: flash attention (its fused backward or warp-specialised forward) failed here; "
                "the two-kernel flash path passed, and this run uses it (--attention flash-split): slower")
        print(line)
        print("WARNING: " + line, file=sys.stderr)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "run-id.txt"), "w") as log:
        log.write("step:0/%d val_loss:10.8 train_time:0ms step_avg:0.00ms\\n" % N)  # no step line
        seeds = [args[i + 1] for i, a in enumerate(args) if a == "--seed"]
        for step in range(1, (int(flag("--fake-stop")) if "--fake-stop" in args else N) + 1):
            log.write("step:%d/%d train_time:%dms step_avg:%.2fms\\n" % (step, N, step * step_ms, step_ms))
            print("step:%d/%d train_time:%dms step_avg:%.2fms loss:%.4f" %
                  (step, N, step * step_ms, step_ms, 10.0 / step + (seeds[-1:] == ["2"])))
    if "--fake-stop" in args:
        sys.exit(3)
    if os.environ.get("CUDA_INJECTION64_PATH") and "--profile-step" in args:
        ns = step_ms * 1000000
        with open(os.environ["KERNEL_PROFILE_OUT"], "w") as out:
            out.write("range,0,0,%d\\n" % ns)
            out.write("kernel,0,%d,7,void flash::backward_dkv_kernel<true>(const __nv_bfloat16*)\\n" % (ns // 2))
            out.write("kernel,%d,%d,7,void flash::backward_dkv_kernel<true>(const __nv_bfloat16*)\\n" % (ns // 2, ns * 3 // 4))
            out.write("kernel,%d,%d,7,void add_into_kernel(const __nv_bfloat16*)\\n" % (ns * 3 // 4, ns * 9 // 10))
    """

STAND_INS = {
    # nvidia-smi: FAKE_GPUS H100s (none: it fails as without a driver).
    "bin/nvidia-smi": """\
        #!/usr/bin/env bash
        gpus=${FAKE_GPUS:-0}
        ((gpus > 0)) || { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9; }
        case ${1:-} in
          -L) for ((i = 0; i < gpus; i++)); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done ;;
          --query-gpu=*) for ((i = 0; i < gpus; i++)); do echo "$i, NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB"; done ;;
          *) echo "| NVIDIA-SMI 580.159.04    Driver Version: 580.159.04    CUDA Version: 13.0 |" ;;
        esac
        """,
    "bin/nvcc": """\
        #!/usr/bin/env bash
        echo "Cuda compilation tools, release 13.0, V13.0.88"
        """,
    # cmake: configures (a cache file) and builds (nothing); FAKE_BUILD_FAILS fails every build.
    "bin/cmake": """\
        #!/usr/bin/env bash
        echo "cmake $*" >>"$FAKE_CALLS.commands"
        case $1 in
          --version) echo "cmake version 3.31.6" ;;
          --preset) mkdir -p build && touch build/CMakeCache.txt ;;
          --build) [[ -z ${FAKE_BUILD_FAILS:-} ]] || { echo "error: nvcc failed"; exit 1; }
                   if [[ -n ${FAKE_BUILD_MAKES:-} ]]; then  # the targets, as files: "made by <folder>"
                     for ((i = 1; i <= $#; i++)); do [[ ${!i} == --target ]] && break; done
                     for target in "${@:i+1}"; do echo "made by $(basename "$PWD")" >"$2/$target"; done
                   fi ;;
        esac
        """,
    # ctest: CTest's lines for the fast or the slow tests; FAKE_FAILING_TEST fails that one.
    "bin/ctest": """\
        #!/usr/bin/env bash
        echo "ctest $* (SPEEDRUN_TEST_SUBSET=${SPEEDRUN_TEST_SUBSET:-unset})" >>"$FAKE_CALLS.commands"
        tests="gpu_device test_kernels test_attention nan_stop"
        [[ " $* " == *" -L slow "* ]] && tests="test_model test_training test_distributed"
        echo "Test project $PWD/build"
        i=0 failed=0
        for t in $tests; do
          i=$((i + 1))
          if [[ $t == "${FAKE_FAILING_TEST:-}" ]]; then
            printf '%d/4 Test #%d: %s ....................***Failed   12.50 sec\\n' $i $i "$t"
            failed=1
          else
            printf '%d/4 Test #%d: %s ....................   Passed    0.81 sec\\n' $i $i "$t"
          fi
        done
        if ((failed)); then echo "75% tests passed, 1 tests failed out of $i"; exit 8; fi
        echo "100% tests passed, 0 tests failed out of $i"
        """,
    "tests/gpu/smoke_run.sh": """\
        #!/usr/bin/env bash
        echo "step:30/30 val_loss:7.2"
        echo "validation losses: 10.83 9.10 8.00 7.20"
        echo "the trainer reports: Running CUDA driver 13.0, runtime 13.0, cuBLASLt 130100, NCCL 22805"
        echo "smoke run passed: 10.83 -> 7.20"
        """,
    "build/bench_kernels": """\
        #!/usr/bin/env bash
        echo "NVIDIA H100 80GB HBM3, 132 SMs, median of $1 runs"
        echo
        echo "| kernel | ms | achieved | of peak |"
        echo "|---|---|---|---|"
        echo "| rmsnorm fwd [49152, 768] | 0.056 | 2.68 TB/s | 89.1% |"
        """,
    "tools/bench_torch.py": """\
        import sys
        print("NVIDIA H100 80GB HBM3, PyTorch 2.11.0+cu130, median of 20 runs\\n")
        print("| PyTorch op | torch ms | ours ms | ours / torch |\\n|---|---|---|---|")
        print("| compiled F.rms_norm fwd | 0.070 | 0.056 | 0.80 |")
        """,
    # run.sh: the trainer's self-check (FAKE_SELF_CHECK: pass, fail or unknown, a trainer without it)
    # or an oracle run, which writes the final checkpoint of every rank: the tiny parameters, lm_head
    # scaled by 1 + 1e-4 (rank + 1); FAKE_BROKEN "<mode>:<W>" scales it by 2 in that run, and
    # FAKE_RUN_FAILS "<mode>:<W>" makes that run fail. A rank a launcher started (RANK set, with the
    # launcher's other variables, else it exits 2) compares its flags with its peer's, as the trainer
    # does, unless FAKE_FLAGS_VOTE is "none" (every rank trains on), "none:<rank>" (that one does) or
    # "hang".
    "run.sh": """\
        import json, os, sys, time
        sys.path.insert(0, os.environ["FAKE_TESTS"])
        import checkpoint_files as cf
        args = sys.argv[1:]
        def flag(name):
            return args[args.index(name) + 1]
        if "RANK" in os.environ:
            rank, port = int(os.environ["RANK"]), os.environ["MASTER_PORT"]
            with open(os.environ["FAKE_CALLS"] + ".ranks", "a") as calls:
                calls.write(json.dumps({"RANK": rank, "WORLD_SIZE": os.environ["WORLD_SIZE"], "args": args}) + "\\n")
            launcher = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
            if [os.environ.get(name) for name in launcher] != ["2", "2", str(rank), "127.0.0.1"]:
                print("error: a launcher's environment without " + ", ".join(launcher))
                sys.exit(2)
            vote = os.environ.get("FAKE_FLAGS_VOTE", "")
            if vote == "hang":
                time.sleep(60)
            mine, peer = (f"{os.environ['FAKE_CALLS']}.flags.{port}.{r}" for r in (rank, 1 - rank))
            with open(mine, "w") as out:
                out.write(" ".join(args))
            if vote in ("none", f"none:{rank}"):
                sys.exit(0)
            while not os.path.exists(peer):
                time.sleep(0.05)
            time.sleep(0.1)  # its whole line
            if open(peer).read() != " ".join(args):
                print(f"error: the ranks were started with different flags (rank {rank}'s: ...)")
                sys.exit(1)
            sys.exit(0)
        W = int(os.environ["NPROC"])
        with open(os.environ["FAKE_CALLS"], "a") as calls:
            calls.write(json.dumps({"NPROC": W, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                    "SPEEDRUN_TRAINER": os.environ.get("SPEEDRUN_TRAINER"), "args": args}) + "\\n")
        if "--self-check-only" in args:
            behaviour = os.environ.get("FAKE_SELF_CHECK", "pass")
            if behaviour == "unknown":
                print("error: unknown flag --self-check (--help lists the flags)")
                sys.exit(2)
            print("self-check flash attention forward: rel. error 1.2e-03 (bound 2e-02) ok")
            verdict = "FAILED" if behaviour == "fail" else "ok"
            print(f"self-check fp8 head logits: rel. error 3.1e-01 (bound 5e-02) {verdict}" if behaviour == "fail" else
                  "self-check fp8 head logits: rel. error 4.0e-03 (bound 5e-02) ok")
            if behaviour == "fail":  # a check whose process hung
                print("self-check batched Muon 768x768: hung: no result in 60 s (its process was ended) FAILED")
            print(f"self-check: {2 + (behaviour == 'fail')} checks, {2 * (behaviour == 'fail')} failed, 2.1 s")
            sys.exit(6 if behaviour == "fail" else 0)
        if "--diloco-groups" in args:  # FAKE_RUN_FAILS "diloco:<W>" fails that one
            if f"diloco:{W}" == os.environ.get("FAKE_RUN_FAILS"):
                print("error: ranks disagree on parameter embed.weight (rank 0 differs from the mean)")
                sys.exit(1)
            for fragment, step in ((0, 3), (1, 4), (0, 4), (1, 4)):
                print(f"diloco: fragment {fragment} synced after step {step} (exchange started after step 2): ...")
            sys.exit(0)
        run = f"{flag('--grad-comm')}:{W}"
        if run == os.environ.get("FAKE_RUN_FAILS"):
            print("error: NCCL error: unhandled system error")
            sys.exit(1)
        step = int(flag("--num-iterations"))
        for rank in range(W):
            scale = 2.0 if run == os.environ.get("FAKE_BROKEN") else 1 + 1e-4 * (rank + 1) * (W > 1)
            masters = [m * scale for m in cf.TINY_MASTERS[:6]] + cf.TINY_MASTERS[6:]
            folder = flag("--checkpoint-dir") + (f"/rank{rank}" if W > 1 else "")
            cf.write_checkpoint(f"{folder}/step_{step:06d}.ckpt", step,
                                cf.parameter_blobs(cf.TINY_EMBEDDINGS, masters, cf.TINY_LAYOUT))
        """,
    "build/train_gpt": PROGRAM.replace("STEP_MS", "90 * M + 10"),  # 730 ms at M = 8, 100 at M = 1
    "tools/record_pytorch.py": PROGRAM.replace("STEP_MS", "95 * M + 25"),  # 785 and 120
    # compute-sanitizer: runs the test it is given and writes its report into --log-file.
    # FAKE_SANITIZER: "fault:<test>:<tool>" reports an invalid write there, "unsupported" answers as
    # on a machine whose GPU it cannot use, "hang:<test>" sleeps there.
    "bin/compute-sanitizer": """\
        import os, subprocess, sys, time
        args = sys.argv[1:]
        tool, log = args[args.index("--tool") + 1], args[args.index("--log-file") + 1]
        options = ("--tool", "--log-file", "--print-limit", "--report-api-errors", "--racecheck-report")
        at = 0
        while args[at] in options:
            at += 2
        program = args[at]
        test = os.path.basename(program) + ("(opt-in)" if "--qkv-backward" in args else "")
        with open(os.environ["FAKE_CALLS"] + ".commands", "a") as calls:
            calls.write(f"compute-sanitizer {' '.join(args)} SPEEDRUN_TEST_SUBSET={os.environ.get('SPEEDRUN_TEST_SUBSET')}\\n")
        behaviour = os.environ.get("FAKE_SANITIZER", "")
        with open(log, "w") as out:
            out.write("========= COMPUTE-SANITIZER\\n")
            if behaviour == "unsupported":
                out.write("========= Error: Device not supported\\n")
                sys.exit(1)
            if behaviour == f"hang:{test}":
                out.flush()
                time.sleep(30)
            status = subprocess.run(args[at:]).returncode
            if behaviour == f"fault:{test}:{tool}":
                out.write("========= Invalid __global__ write of size 4 bytes\\n"
                          "=========     at flash_backward_kernel<(int)128>(const Args &)+0x1a30 in kernels/flash_attention.cuh:812\\n"
                          "=========     by thread (3,0,0) in block (0,0,0)\\n"
                          "=========\\n========= Program hit cudaErrorLaunchFailure on CUDA API call to cudaDeviceSynchronize.\\n")
                status = status or 1
            errors = int(behaviour == f"fault:{test}:{tool}")
            out.write(f"========= RACECHECK SUMMARY: 0 hazards displayed ({errors} errors, 0 warnings)\\n" if tool == "racecheck"
                      else f"========= ERROR SUMMARY: {errors} error{'s' * (errors != 1)}\\n")
        sys.exit(status)
        """,
    # ncu: FAKE_NCU=fail answers as on a machine whose counters cannot be read.
    "bin/ncu": """\
        #!/usr/bin/env bash
        echo "ncu $*" >>"$FAKE_CALLS.commands"
        if [[ ${FAKE_NCU:-} == fail ]]; then echo "==ERROR== ERR_NVGPUCTRPERM: no permission"; exit 1; fi
        echo "==PROF== Connected to process 1"
        echo '"ID","Kernel Name","gpu__time_duration.sum","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"'
        echo '"","","us","%"'
        echo '"0","void softcap_cross_entropy_kernel<S>(const __nv_bfloat16*)","600","75"'
        """,
}


class AcceptanceTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="acceptance_")
        self.addCleanup(shutil.rmtree, self.root)
        self.repo = os.path.join(self.root, "repo")
        for tool in ("acceptance.sh", "compare_checkpoints.py", "profile_summary.py", "timeline_summary.py",
                     "stage_build.sh"):
            os.makedirs(os.path.join(self.repo, "tools"), exist_ok=True)
            shutil.copy(os.path.join(ROOT, "tools", tool), os.path.join(self.repo, "tools", tool))
        for path, text in STAND_INS.items():
            full = os.path.join(self.repo, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            text = textwrap.dedent(text)
            if path.endswith(".py") or path in ("run.sh", "build/train_gpt", "bin/compute-sanitizer"):
                text = f"#!{sys.executable}\n" + text
            with open(full, "w") as f:
                f.write(text)
            os.chmod(full, os.stat(full).st_mode | stat.S_IXUSR)
        os.symlink(sys.executable, os.path.join(self.repo, "bin", "python3"))  # this Python has numpy
        for path in ("corpus-bin/corpus_train_000001.bin", ".carry/anchor/train_gpt.py"):  # staged there
            os.makedirs(os.path.dirname(os.path.join(self.repo, path)), exist_ok=True)
            open(os.path.join(self.repo, path), "w").close()
        self.calls = os.path.join(self.root, "calls.jsonl")
        self.report = os.path.join(self.root, "report.md")

    def acceptance(self, *phases, gpus=0, **env):
        environment = dict(os.environ, PATH=os.path.join(self.repo, "bin") + os.pathsep + os.environ["PATH"],
                           FAKE_GPUS=str(gpus), FAKE_CALLS=self.calls, FAKE_TESTS=HERE,
                           ACCEPTANCE_REPORT=self.report, **env)
        for name in ("OUT", "CUDA_VISIBLE_DEVICES"):
            if name not in env:
                environment.pop(name, None)
        result = subprocess.run(["bash", os.path.join(self.repo, "tools", "acceptance.sh"), *phases],
                                env=environment, capture_output=True, text=True, timeout=300)
        return result.returncode, self.read(self.report), result.stdout + result.stderr

    @staticmethod
    def read(path):
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()

    def built_kernel_tests(self):
        """The gpu tests' binaries that the sanitize phase runs (FAKE_FAILING_TEST fails that one)."""
        for test in ("gpu_device", "test_kernels", "test_attention", "test_residual", "test_fp8_head", "test_muon"):
            full = os.path.join(self.repo, "build", "tests", test)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(f'#!/usr/bin/env bash\necho "{test}: subset $SPEEDRUN_TEST_SUBSET"\n'
                        f'[[ ${{FAKE_FAILING_TEST:-}} != {test} ]]\n')
            os.chmod(full, 0o755)

    def staged(self, archive):
        """The files of a .carry archive, sorted."""
        with tarfile.open(os.path.join(self.repo, ".carry", archive)) as tar:
            return sorted(os.path.normpath(m.name) for m in tar.getmembers() if m.isfile())

    def commands(self):
        """The cmake and ctest command lines, one a line."""
        return self.read(self.calls + ".commands")

    def run_programs(self):
        """The trainer's and the record code's command lines, one a line."""
        return self.read(self.calls + ".programs").splitlines()

    def run_sh_calls(self):
        return [json.loads(line) for line in self.read(self.calls).splitlines()]

    def test_an_unknown_phase_is_a_usage_error(self):
        status, _, output = self.acceptance("build", "benchmarks")
        self.assertEqual(status, 2)
        self.assertIn("[build|tests|sanitize|slow|smoke|self-check|bench|anchor|profile|nccl]...", output)
        self.assertEqual(self.commands(), "")

    def test_without_a_gpu_the_gpu_phases_say_so_and_build_nothing(self):
        phases = ("tests", "sanitize", "slow", "smoke", "self-check", "bench", "anchor", "profile", "nccl")
        status, report, output = self.acceptance(*phases)
        self.assertEqual(status, 77, output)
        self.assertIn("- GPUs: none (nvidia-smi lists no GPU)", report)
        for phase in phases:
            self.assertIn(f"## {phase}\n", report)
            self.assertIn(f"**{phase}: no GPU: skipped**", report)
        self.assertEqual(report.count("No GPU (nvidia-smi lists none): skipped."), 9)
        self.assertNotIn("--build", self.commands())
        self.assertNotIn("ctest", self.commands())
        self.assertEqual(self.run_sh_calls(), [])

    def test_one_gpu_every_phase_passes_into_one_report(self):
        self.built_kernel_tests()
        out = os.path.join(self.root, "out")
        os.makedirs(out)
        status, report, output = self.acceptance(gpus=1, OUT=out, SPEEDRUN_TEST_SUBSET="1")
        self.assertEqual(status, 0, output)
        self.assertIn("- GPUs (index, name, driver, memory):\n  - 0, NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB", report)
        self.assertIn("- driver's CUDA Version: 13.0", report)
        self.assertIn("- nvcc: release 13.0, V13.0.88", report)
        every_phase = ("build", "tests", "sanitize", "slow", "smoke", "self-check", "bench", "anchor", "profile", "nccl")
        self.assertEqual(re.findall(r"^## (\S+)$", report, re.M), list(every_phase))
        for phase in every_phase:
            self.assertIn(f"**{phase}: passed**", report)
        self.assertIn("Built gpu_tests bench_kernels", report)
        self.assertIn("| test | result | time |\n|---|---|---|\n| gpu_device | Passed | 0.81 s |\n"
                      "| test_kernels | Passed | 0.81 s |", report)
        self.assertIn("| test_distributed | Passed | 0.81 s |", report)
        self.assertIn("100% tests passed, 0 tests failed out of 3", report)
        self.assertIn("- validation losses: 10.83 9.10 8.00 7.20\n- the trainer reports: Running CUDA driver 13.0, "
                      "runtime 13.0, cuBLASLt 130100, NCCL 22805", report)
        self.assertIn("| 0 | flash attention forward | 1.2e-03 | 2e-02 | ok |", report)
        self.assertIn("- GPU 0: self-check: 2 checks, 0 failed, 2.1 s", report)
        self.assertNotIn("The line that faults", report)  # nothing failed
        self.assertIn("| rmsnorm fwd [49152, 768] | 0.056 | 2.68 TB/s | 89.1% |", report)
        self.assertIn("| compiled F.rms_norm fwd | 0.070 | 0.056 | 0.80 |", report)
        self.assertIn("One GPU: W ranks share it (`--ranks-share-gpu`", report)
        commands = self.commands()
        self.assertIn("ctest --test-dir build -L gpu -LE slow -E ^smoke_run$", commands)
        self.assertIn("ctest --test-dir build -L slow -j 3", commands)
        self.assertNotIn("SPEEDRUN_TEST_SUBSET=1)", commands)  # the verdict at full shapes, whatever the caller set
        self.assertEqual(commands.count("cmake --preset release"), 1)  # configured once, then built per phase
        self.assertIn("--target slow_gpu_tests", commands)
        self.assertEqual(self.run_sh_calls()[0]["args"][:3], ["--self-check", "strict", "--self-check-only"])
        # OUT holds what the device tool brings back (8 files at most): the report, and one log per
        # phase with the runs' folders packed into one archive.
        self.assertEqual(sorted(os.listdir(out)), ["report.md", "report.tar.gz"])
        self.assertEqual(self.read(os.path.join(out, "report.md")), report)
        with tarfile.open(os.path.join(out, "report.tar.gz")) as packed:
            names = packed.getnames()
        for phase in every_phase:
            self.assertIn(f"report/{phase}.log", names)
        self.assertIn("report/anchor/ours_M8/console.txt", names)
        self.assertIn("report/profile/ours/kernels.csv", names)

    def test_failures_are_named_in_the_report_and_on_the_console(self):
        self.built_kernel_tests()
        status, report, output = self.acceptance("tests", "self-check", gpus=1, FAKE_FAILING_TEST="test_attention",
                                                 FAKE_SELF_CHECK="fail")
        self.assertEqual(status, 1)
        self.assertIn("| test_attention | Failed | 12.50 s |", report)
        self.assertIn('The line that faults, if one does: `SANITIZE_RUNS="memcheck:test_attention" '
                      'tools/acceptance.sh sanitize`.', report)
        self.assertIn("**tests: FAILED**", report)
        self.assertIn("| 0 | fp8 head logits | 3.1e-01 | 5e-02 | FAILED |", report)
        self.assertIn("| 0 | batched Muon 768x768 | - | - | FAILED: hung: no result in 60 s (its process was ended) |",
                      report)
        self.assertIn("- GPU 0: self-check: 3 checks, 2 failed, 2.1 s\n\nThe line that faults, if one does: "
                      "`tools/acceptance.sh sanitize` (the kernels' tests and the trainer with every fast path under "
                      "compute-sanitizer).", report)
        self.assertIn("**self-check: FAILED**", report)
        self.assertIn(f"send {self.report} and the failed phases' .log files", output)

    def test_the_sanitize_phase_runs_each_tool_over_the_kernel_tests_at_the_ci_sized_shapes(self):
        self.built_kernel_tests()
        status, report, output = self.acceptance("sanitize", gpus=1)
        self.assertEqual(status, 0, output)
        self.assertIn("the tests at the CI-sized shapes (SPEEDRUN_TEST_SUBSET=1)", report)
        rows = re.findall(r"^\| ([\w() -]+?) \| (\w+) \| clean \(\d+ s\) \|  \|$", report, re.M)
        self.assertEqual(rows, [("test_attention", "memcheck"), ("test_kernels", "memcheck"),
                                ("test_attention", "synccheck"), ("test_kernels", "synccheck"),
                                ("test_attention", "racecheck"), ("test_kernels", "racecheck"),
                                ("train_gpt", "memcheck"), ("train_gpt (opt-in)", "memcheck"),
                                ("gpu_device (setmaxnreg)", "memcheck"), ("gpu_device (setmaxnreg)", "synccheck"),
                                ("test_residual", "memcheck"), ("test_fp8_head", "memcheck"), ("test_muon", "memcheck")])
        sanitized = [line for line in self.commands().splitlines() if line.startswith("compute-sanitizer")]
        self.assertEqual(len(sanitized), 13)
        self.assertTrue(all(line.endswith("SPEEDRUN_TEST_SUBSET=1") for line in sanitized), sanitized)
        self.assertIn("--tool memcheck --report-api-errors no --print-limit 20 --log-file", sanitized[0])
        self.assertIn("build/tests/gpu_device setmaxnreg SPEEDRUN_TEST_SUBSET=1", sanitized[8])
        trainer_runs = [line for line in self.run_programs() if line.startswith("train_gpt ")]
        self.assertEqual(len(trainer_runs), 2)
        for line in trainer_runs:
            self.assertIn("--num-iterations 2 --micro-batches 1 --seq-len 4096", line)
            self.assertIn("--self-check off", line)
        self.assertNotIn("--qkv-backward fused", trainer_runs[0])
        self.assertIn("--attention flash-ws --mlp-fc fused --qkv fused --qkv-backward fused --launch-overlap pdl",
                      trainer_runs[1])
        self.assertIn("--tool racecheck --report-api-errors no --print-limit 20 --log-file", sanitized[5])
        self.assertIn("--racecheck-report hazard build/tests/test_kernels", sanitized[5])
        self.assertIn("**sanitize: passed**", report)

    def test_a_sanitizer_finding_names_its_kernel_and_line_and_fails_the_phase(self):
        self.built_kernel_tests()
        status, report, _ = self.acceptance("sanitize", gpus=1, FAKE_SANITIZER="fault:test_attention:memcheck",
                                            FAKE_FAILING_TEST="test_muon",
                                            SANITIZE_RUNS="memcheck:test_attention racecheck:test_attention memcheck:test_muon")
        self.assertEqual(status, 1)
        self.assertIn("| test_attention | memcheck | FAILED: 1 errors | Invalid __global__ write of size 4 bytes; "
                      "at flash_backward_kernel<(int)128>(const Args &)+0x1a30 in kernels/flash_attention.cuh:812 |", report)
        self.assertRegex(report, r"\| test_attention \| racecheck \| clean \(\d+ s\) \|  \|")
        self.assertIn("| test_muon | memcheck | FAILED: the test failed (exit 1), no sanitizer errors |  |", report)
        self.assertIn("**sanitize: FAILED**", report)

    def test_a_hung_sanitizer_run_ends_at_its_timeout_and_the_budget_stops_the_rest(self):
        self.built_kernel_tests()
        # The budget counts bash's whole seconds (SECONDS): 3 s is spent only by the hung run's 5 s,
        # never by the phase's start (a budget of 1 s was, where that start crossed a second boundary).
        status, report, _ = self.acceptance("sanitize", gpus=1, FAKE_SANITIZER="hang:test_kernels",
                                            ACCEPTANCE_SANITIZE_TIMEOUT="5", ACCEPTANCE_SANITIZE_BUDGET="3",
                                            SANITIZE_RUNS="memcheck:test_kernels memcheck:test_attention")
        self.assertEqual(status, 1)
        self.assertIn("| test_kernels | memcheck | FAILED: still running after ACCEPTANCE_SANITIZE_TIMEOUT=5 s |  |", report)
        self.assertIn("| test_attention | memcheck | not run: the phase spent its ACCEPTANCE_SANITIZE_BUDGET=3 s | |",
                      report)

    def test_without_a_usable_sanitizer_the_phase_says_why(self):
        self.built_kernel_tests()
        status, report, _ = self.acceptance("sanitize", gpus=1, FAKE_SANITIZER="unsupported")
        self.assertEqual(status, 77)
        self.assertIn("| test_attention | memcheck | not run: compute-sanitizer does not support this machine's GPU | "
                      "Error: Device not supported |", report)
        self.assertIn("**sanitize: compute-sanitizer cannot use this GPU: skipped**", report)
        status, report, _ = self.acceptance("sanitize", "tests", gpus=1, COMPUTE_SANITIZER="/nonexistent/compute-sanitizer")
        self.assertEqual(status, 77)
        self.assertIn("No compute-sanitizer (/nonexistent/compute-sanitizer): nothing checked.", report)
        self.assertIn("**sanitize: no compute-sanitizer: skipped**", report)
        self.assertIn("**tests: passed**", report)
        for runs in ("memcheck:test_kernels asan:test_kernels", " ", "memcheck:train_gpt:fast"):
            status, report, _ = self.acceptance("sanitize", gpus=1, SANITIZE_RUNS=runs)
            self.assertEqual(status, 1)
            self.assertIn(f"SANITIZE_RUNS: '{runs.split()[-1] if runs.strip() else 'none'}' is not tool:test, "
                          "tool:test:case, tool:train_gpt or tool:train_gpt:opt-in (tool: memcheck, racecheck, "
                          "synccheck or initcheck).", report)

    def test_a_refusal_after_a_finding_still_fails_the_phase_and_an_earlier_report_is_not_read(self):
        self.built_kernel_tests()
        stale = os.path.join(self.root, "report", "sanitize", "test_kernels_memcheck.txt")
        os.makedirs(os.path.dirname(stale))
        with open(stale, "w") as f:
            f.write("========= Error: Device not supported\n")
        status, report, _ = self.acceptance("sanitize", gpus=1, FAKE_SANITIZER="fault:test_attention:memcheck",
                                            SANITIZE_RUNS="memcheck:test_attention memcheck:test_kernels")
        self.assertEqual(status, 1)
        self.assertRegex(report, r"\| test_kernels \| memcheck \| clean \(\d+ s\) \|  \|")
        status, report, _ = self.acceptance("sanitize", gpus=1, FAKE_SANITIZER="unsupported",
                                            SANITIZE_RUNS="memcheck:test_attention")
        self.assertEqual(status, 77)
        os.remove(self.report)
        with open(os.path.join(self.repo, "bin", "compute-sanitizer"), "w") as f:  # one that fails a run, then refuses
            f.write("#!/usr/bin/env bash\nlog=$(sed -E 's/.*--log-file ([^ ]+).*/\\1/' <<<\"$*\")\n"
                    "if [[ $* == *test_attention* ]]; then echo '========= ERROR SUMMARY: 1 error' >\"$log\"; exit 1; fi\n"
                    "echo '========= Error: Device not supported'\nexit 1\n")
        status, report, _ = self.acceptance("sanitize", gpus=1, SANITIZE_RUNS="memcheck:test_attention memcheck:test_kernels")
        self.assertEqual(status, 1)
        self.assertIn("| test_attention | memcheck | FAILED: 1 errors |  |", report)
        self.assertIn("| test_kernels | memcheck | not run: compute-sanitizer does not support this machine's GPU | "
                      "Error: Device not supported |", report)
        self.assertIn("**sanitize: FAILED**", report)

    def test_a_failed_build_stops_its_phase(self):
        status, report, _ = self.acceptance("build", gpus=1, FAKE_BUILD_FAILS="1")
        self.assertEqual(status, 1)
        self.assertIn("Building gpu_tests bench_kernels FAILED: the end of build.log says why.", report)

    def test_a_prebuilt_build_is_used_as_it_is(self):
        status, report, output = self.acceptance("build", "tests", "self-check", gpus=1, SPEEDRUN_PREBUILT="1")
        self.assertEqual(status, 0, output)
        self.assertIn("SPEEDRUN_PREBUILT: build/ used as it is (gpu_tests bench_kernels not rebuilt).", report)
        self.assertNotIn("cmake --preset", self.commands())
        self.assertNotIn("cmake --build", self.commands())
        self.assertEqual(self.run_sh_calls()[0]["SPEEDRUN_TRAINER"], os.path.join(self.repo, "build", "train_gpt"))
        os.remove(os.path.join(self.repo, "build", "bench_kernels"))
        status, report, _ = self.acceptance("bench", gpus=1, SPEEDRUN_PREBUILT="1")
        self.assertEqual(status, 1)
        self.assertIn("SPEEDRUN_PREBUILT: build/ has no bench_kernels.", report)
        self.assertIn("**bench: FAILED**", report)

    def test_a_build_staged_for_the_device_is_put_back_where_build_has_none(self):
        build = os.path.join(self.repo, "build")
        for path in ("tests/test_kernels", "tests/CTestTestfile.cmake", "CMakeFiles/x.dir/a.o", "tests/emulator/e",
                     "tests/CMakeFiles/t.dir/t.cu.o", "generated/trainer_source.inc", "frozen/train_gpt.cu"):
            os.makedirs(os.path.dirname(os.path.join(build, path)), exist_ok=True)
            open(os.path.join(build, path), "w").close()
        result = subprocess.run(["bash", os.path.join(self.repo, "tools", "stage_build.sh")], capture_output=True,
                                text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("of the tool's 64", result.stdout)
        self.assertEqual(self.staged("build.tar.xz"),
                         ["bench_kernels", "tests/CTestTestfile.cmake", "tests/test_kernels", "train_gpt"])
        shutil.rmtree(build)
        status, report, output = self.acceptance("tests", "self-check", gpus=1, SPEEDRUN_PREBUILT="1")
        self.assertEqual(status, 0, output)
        self.assertTrue(os.access(os.path.join(build, "train_gpt"), os.X_OK))
        self.assertIn("SPEEDRUN_PREBUILT: build/ used as it is", report)

    def test_staging_a_configured_build_first_builds_what_the_gpu_runs(self):
        # the gpu tests are not in `all` without a GPU: a stale one must not be carried
        build = os.path.join(self.repo, "build")
        for path in ("CMakeCache.txt", "tests/test_model"):
            os.makedirs(os.path.dirname(os.path.join(build, path)), exist_ok=True)
            open(os.path.join(build, path), "w").close()
        environment = dict(os.environ, PATH=os.path.join(self.repo, "bin") + os.pathsep + os.environ["PATH"],
                           FAKE_CALLS=self.calls)
        run = lambda **env: subprocess.run(["bash", os.path.join(self.repo, "tools", "stage_build.sh")],
                                           capture_output=True, text=True, timeout=60, env=dict(environment, **env))
        result = run()
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("cmake --build build -j 2 --target gpu_tests bench_kernels", self.commands())
        self.assertIn("tests/test_model", self.staged("build.tar.xz"))
        result = run(FAKE_BUILD_FAILS="1")
        self.assertEqual(result.returncode, 1)
        self.assertIn("building gpu_tests and bench_kernels failed: nothing staged", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.repo, ".carry", "build.tar.xz")))  # the earlier staging is gone

    def test_staging_a_baseline_builds_that_commits_trainer_and_bench_in_a_worktree(self):
        git = lambda *args: subprocess.run(["git", "-C", self.repo, "-c", "user.name=t", "-c", "user.email=t@t", *args],
                                           capture_output=True, text=True, check=True).stdout.strip()
        git("init", "-q")
        git("add", "-A")
        git("commit", "-qm", "the baseline")
        revision = git("rev-parse", "HEAD")
        environment = dict(os.environ, PATH=os.path.join(self.repo, "bin") + os.pathsep + os.environ["PATH"],
                           FAKE_CALLS=self.calls, FAKE_BUILD_MAKES="1")
        run = lambda **env: subprocess.run(["bash", os.path.join(self.repo, "tools", "stage_build.sh")],
                                           capture_output=True, text=True, timeout=60, env=dict(environment, **env))
        result = run(SPEEDRUN_BASELINE="HEAD")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f".carry/baseline.tar.xz: the trainer and bench_kernels of {revision[:7]}", result.stdout)
        self.assertIn("cmake --build build -j 2 --target train_gpt bench_kernels", self.commands())
        baseline = os.path.join(self.repo, ".carry", "baseline.tar.xz")
        with tarfile.open(baseline) as archive:
            self.assertEqual(archive.extractfile("REVISION").read().decode().strip(), revision)
            for target in ("train_gpt", "bench_kernels"):  # built in the worktree, not in this checkout's build/
                self.assertEqual(archive.extractfile(target).read().decode().strip(), "made by src")
        # on the GPU machine: unpacked into .carry/baseline/, where acceptance.sh looks
        self.assertEqual(subprocess.run(["bash", os.path.join(self.repo, "tools", "stage_build.sh"), "unpack"],
                                        timeout=60).returncode, 0)
        self.assertEqual(self.read(os.path.join(self.repo, ".carry", "baseline", "REVISION")).strip(), revision)
        self.assertEqual(len(git("worktree", "list").splitlines()), 1)  # the worktree is gone
        result = run()  # carried as it is, and said so; the unpacked copy is not carried
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"the trainer and bench_kernels of {revision[:7]}", result.stdout)
        self.assertFalse(os.path.exists(os.path.join(self.repo, ".carry", "baseline")))
        result = run(SPEEDRUN_BASELINE="no-such-commit")
        self.assertEqual(result.returncode, 1)
        self.assertIn("SPEEDRUN_BASELINE=no-such-commit is not a commit of this repository", result.stderr)
        self.assertFalse(os.path.exists(baseline))  # no stale baseline carried by mistake
        result = run(SPEEDRUN_BASELINE="HEAD", FAKE_BUILD_FAILS="1")
        self.assertEqual(result.returncode, 1)
        self.assertIn(f"building the baseline {revision[:7]}'s train_gpt and bench_kernels failed", result.stderr)
        self.assertEqual(len(git("worktree", "list").splitlines()), 1)

    def test_a_trainer_without_the_self_check_is_reported_as_missing(self):
        status, report, _ = self.acceptance("self-check", gpus=1, FAKE_SELF_CHECK="unknown")
        self.assertEqual(status, 1)
        self.assertIn("MISSING: this trainer has no --self-check", report)

    def test_the_self_check_runs_on_each_visible_gpu(self):
        status, report, output = self.acceptance("self-check", gpus=8, CUDA_VISIBLE_DEVICES="2,5")
        self.assertEqual(status, 0, output)
        self.assertEqual([c["CUDA_VISIBLE_DEVICES"] for c in self.run_sh_calls()], ["2", "5"])
        self.assertIn("- GPU 2: self-check: 2 checks, 0 failed, 2.1 s\n- GPU 5: self-check:", report)

    def test_the_nccl_oracle_compares_every_mode_and_world_size_with_one_rank(self):
        status, report, output = self.acceptance("nccl", gpus=4, FAKE_BROKEN="bf16-rs:4",
                                                 FAKE_RUN_FAILS="a2a-fp32acc:2")
        self.assertEqual(status, 1, output)
        runs = [(c["NPROC"], c["args"][c["args"].index("--grad-comm") + 1] if "--grad-comm" in c["args"] else "diloco")
                for c in self.run_sh_calls()]
        self.assertEqual(runs, [(1, "fp32-rs"), (2, "fp32-rs"), (2, "bf16-rs"), (2, "a2a-fp32acc"),
                                (4, "fp32-rs"), (4, "bf16-rs"), (4, "a2a-fp32acc"), (2, "diloco"), (4, "diloco")])
        args = self.run_sh_calls()[0]["args"]
        for flag, value in (("--micro-batches", "8"), ("--seed", "1234"), ("--warmup-steps", "0"),
                            ("--num-iterations", "4")):
            self.assertEqual(args[args.index(flag) + 1], value)
        rows = re.findall(r"^\| (\S+) \| (\d) \| (.*) \| (\S+) \| (\S+) \| \d+ s \|$", report, re.M)
        self.assertEqual([(mode, W, bound, verdict) for mode, W, _, bound, verdict in rows],
                         [("fp32-rs", "2", "0.1", "ok"), ("bf16-rs", "2", "0.5", "ok"),
                          ("a2a-fp32acc", "2", "0.5", "FAILED"), ("fp32-rs", "4", "0.1", "ok"),
                          ("bf16-rs", "4", "0.5", "FAILED"), ("a2a-fp32acc", "4", "0.5", "ok")])
        self.assertRegex(rows[0][2], r"^2\.000e-04 \(lm_head\.weight, rank1\)$")
        self.assertRegex(rows[5][2], r"^4\.000e-04 \(lm_head\.weight, rank3\)$")
        self.assertEqual(rows[2][2], "the run FAILED (exit 1: error: NCCL error: unhandled system error)")
        self.assertRegex(rows[4][2], r"^1\.000e\+00 \(lm_head\.weight, rank0\)$")
        diloco = re.findall(r"^\| (\d) \| (\d) \| (\d+) \| (ok|FAILED[^|]*) \| \d+ s \|$", report, re.M)
        self.assertEqual(diloco, [("2", "1", "4", "ok"), ("4", "2", "4", "ok")])
        ranks = [json.loads(line) for line in self.read(self.calls + ".ranks").splitlines()]
        self.assertEqual(sorted((r["RANK"], r["WORLD_SIZE"], r["args"][r["args"].index("--diloco-groups") + 1],
                                 "--ranks-share-gpu" in r["args"], "--checkpoint-dir" in r["args"]) for r in ranks),
                         [(0, "2", "2", False, True), (1, "2", "1", False, True)])
        self.assertRegex(report, r"Verdict: ok \(exits 1 1, \d+ s\)\.")

    def test_ranks_with_different_flags_that_train_on_or_hang_fail_the_nccl_phase(self):
        status, report, output = self.acceptance("nccl", gpus=1, FAKE_FLAGS_VOTE="none")
        self.assertEqual(status, 1, output)
        self.assertIn("Verdict: FAILED (rank 0 exit 0: no error line) (exits 0 0", report)
        status, report, output = self.acceptance("nccl", gpus=1, FAKE_FLAGS_VOTE="none:1")
        self.assertEqual(status, 1, output)
        self.assertIn("Verdict: FAILED (rank 1 exit 0: no error line) (exits 1 0", report)
        status, report, output = self.acceptance("nccl", gpus=1, FAKE_FLAGS_VOTE="hang",
                                                 ACCEPTANCE_DISAGREEING_FLAGS_TIMEOUT="1")
        self.assertEqual(status, 1, output)
        self.assertIn("Verdict: FAILED (rank 0 still running after 1 s: hung) (exits 124 124", report)
        ranks = [json.loads(line) for line in self.read(self.calls + ".ranks").splitlines()]
        self.assertTrue(all("--ranks-share-gpu" in r["args"] for r in ranks))

    def test_with_one_gpu_the_nccl_ranks_share_it(self):
        status, report, output = self.acceptance("nccl", gpus=1)
        self.assertEqual(status, 0, output)
        runs = [(c["NPROC"], "--ranks-share-gpu" in c["args"]) for c in self.run_sh_calls()]
        self.assertEqual(runs, [(1, False)] + [(2, True)] * 3 + [(4, True)] * 3 + [(2, True), (4, True)])
        self.assertIn("each rank its own NCCL_HOSTID", report)
        self.assertEqual(len(re.findall(r"^\| [a-z0-9]+-[a-z0-9]+ \| [24] \| .* \| ok \| \d+ s \|$", report, re.M)), 6)
        self.assertEqual(len(re.findall(r"^\| [24] \| [12] \| 4 \| ok \| \d+ s \|$", report, re.M)), 2)

    def test_the_anchor_phase_tables_both_programs_side_by_side(self):
        status, report, output = self.acceptance("anchor", gpus=1)
        self.assertEqual(status, 0, output)
        for who, M, N, ms in (("ours", 8, 20, "730.0"), ("record", 8, 20, "785.0"), ("ours", 1, 60, "100.0"),
                              ("record", 1, 60, "120.0")):
            self.assertRegex(report, rf"\| {who}, M = {M} \| {N} \| \d+ \| {ms} \|")
        self.assertIn("| M | ours ms | record code ms | ours / record |\n|---|---|---|---|\n"
                      "| M = 8 | 730.0 | 785.0 | 0.930 |\n| M = 1 | 100.0 | 120.0 | 0.833 |", report)
        self.assertIn("Side by side on NVIDIA H100 80GB HBM3, ", report)
        # the trainer first, then the record's code, each on the corpus, the record's file staged in .carry
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertEqual([p.split()[0] for p in programs], ["train_gpt", "record_pytorch.py"] * 2)
        self.assertIn("--record .carry/anchor/train_gpt.py --train-files corpus-bin/corpus_train_*.bin", programs[1])
        self.assertIn(" --stall-timeout 120 ", programs[0])  # a hung kernel ends the run, not the device call
        self.assertIn("--micro-batches 8 --num-iterations 20 --sync-steps --no-validation", programs[1])
        self.assertIn("--micro-batches 1 --num-iterations 60 --val-every 0", programs[2])

    def test_anchor_variants_run_the_trainer_again_with_their_flags_beside_the_record(self):
        status, report, output = self.acceptance("anchor", gpus=1,
                                                 ANCHOR_VARIANTS="--attention flash-split;--muon per-matrix --seed 2")
        self.assertEqual(status, 0, output)
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertEqual([p.split()[0] for p in programs], ["train_gpt", "record_pytorch.py", "train_gpt", "train_gpt"] * 2)
        self.assertTrue(programs[2].endswith("--attention flash-split"), programs[2])
        self.assertTrue(programs[3].endswith("--muon per-matrix --seed 2"), programs[3])
        self.assertIn("| M = 8, ours --attention flash-split | 730.0 | 785.0 | 0.930 |", report)
        self.assertIn("| M = 1, ours --muon per-matrix --seed 2 | 100.0 | 120.0 | 0.833 |", report)
        self.assertRegex(report, r"\| ours --attention flash-split, M = 8 \| 20 \| \d+ \| 730.0 \|")
        self.assertIn("- M = 8, ours --attention flash-split: the same at all 20 steps", report)
        self.assertRegex(report, r"\| ours --attention flash-split, M = 8 \| 20 \| \d+ \| 730.0 \| the same at all 20 steps \|")
        self.assertIn("- M = 1, ours --muon per-matrix --seed 2: differ from step 1: 10.0000 against 11.0000", report)
        self.assertTrue(os.path.isdir(os.path.join(os.path.splitext(self.report)[0], "anchor",
                                                   "ours_M8___attention_flash_split")))

    def test_at_bench_in_a_variant_is_the_bench_phase_s_fastest_matmul_algorithms(self):
        with open(os.path.join(self.repo, "build", "bench_kernels"), "a") as f:
            f.write('echo "| matmul: the fastest candidates\' flag | --matmul-algorithms qkv.dx=1,mlp-fc.dw=2 |"\n')
            f.write('echo "| fp8 head fwd: the fastest candidate\'s flag | --fp8-logits-algorithm 3 |"\n')
        status, report, output = self.acceptance("bench", "anchor", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--matmul-algorithms @bench;"
                                                                 "--matmul-algorithms @bench --fp8-logits-algorithm @bench-fp8")
        self.assertEqual(status, 0, output)
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertTrue(programs[2].endswith("--matmul-algorithms qkv.dx=1,mlp-fc.dw=2"), programs[2])
        self.assertTrue(programs[3].endswith("--matmul-algorithms qkv.dx=1,mlp-fc.dw=2 --fp8-logits-algorithm 3"),
                        programs[3])
        # a later call on the same machine (build/ stays) finds them without the bench phase
        os.remove(self.calls + ".programs")
        status, report, output = self.acceptance("anchor", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--matmul-algorithms @bench;--fp8-logits-algorithm @bench-fp8")
        self.assertEqual(status, 0, output)
        self.assertTrue(self.read(self.calls + ".programs").splitlines()[2].endswith("qkv.dx=1,mlp-fc.dw=2"))
        self.assertTrue(self.read(self.calls + ".programs").splitlines()[3].endswith("--fp8-logits-algorithm 3"))
        # neither build/'s value nor the report's line: the variant does not run, the others do
        os.remove(os.path.join(self.repo, "build", "bench_matmul-algorithms.txt"))
        os.remove(os.path.join(self.repo, "build", "bench_fp8-logits-algorithm.txt"))
        os.remove(self.report)
        status, report, output = self.acceptance("anchor", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--matmul-algorithms @bench;--seed 2;"
                                                                 "--fp8-logits-algorithm @bench-fp8")
        self.assertEqual(status, 1, output)  # asked for and not run: the phase fails
        self.assertIn("| ours --matmul-algorithms @bench, M = 8 | 20 | 0 | not run: no bench value for @bench", report)
        self.assertIn("| ours --fp8-logits-algorithm @bench-fp8, M = 8 | 20 | 0 | not run: no bench value", report)
        self.assertIn("- M = 8, ours --seed 2: differ from step 1", report)

    def test_a_bench_that_hangs_ends_at_its_timeout_with_the_rows_it_printed(self):
        with open(os.path.join(self.repo, "build", "bench_kernels"), "a") as f:
            f.write("sleep 30\n")
        start = time.monotonic()
        status, report, _ = self.acceptance("bench", gpus=1, ACCEPTANCE_BENCH_TIMEOUT="1")
        self.assertEqual(status, 1)
        self.assertLess(time.monotonic() - start, 20)
        self.assertIn("bench_kernels FAILED (exit 124: still running after ACCEPTANCE_BENCH_TIMEOUT=1 s", report)
        self.assertIn("| rmsnorm fwd [49152, 768] | 0.056 |", report)  # the rows before the hang

    def test_a_run_whose_self_check_fell_back_says_so_beside_its_time(self):
        status, report, output = self.acceptance("anchor", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--attention flash-ws --fake-fallback;--seed 2")
        self.assertEqual(status, 0, output)
        note = " (self-check fell back: flash attention (its fused backward or warp-specialised forward))"
        self.assertRegex(report, r"\| ours --attention flash-ws --fake-fallback" + re.escape(note) + r", M = 8 \| 20 \|")
        self.assertIn("| M = 8, ours --attention flash-ws --fake-fallback" + note + " | 730.0 |", report)
        self.assertRegex(report, r"\| ours, M = 8 \| 20 \|")  # the runs that did not fall back: no note
        self.assertIn("| M = 8 | 730.0 |", report)
        self.assertEqual(report.count("self-check fell back"), 3)  # its two rows and its loss agreement

    def test_a_variant_that_stops_early_is_not_said_to_agree(self):
        status, report, _ = self.acceptance("anchor", gpus=1, ANCHOR_RUNS="8:20", ANCHOR_VARIANTS="--fake-stop 10")
        self.assertEqual(status, 1)
        self.assertIn("- M = 8, ours --fake-stop 10: the same at the 10 of 20 steps both printed (a run stopped early)",
                      report)
        self.assertRegex(report, r"\| ours --fake-stop 10, M = 8 \| 20 \| \d+ \| FAILED: exit 3 ")

    def test_a_staged_baseline_runs_beside_the_trainer_in_the_anchor_and_bench_phases(self):
        baseline = os.path.join(self.repo, ".carry", "baseline")
        os.makedirs(baseline)
        for name, text in (("train_gpt", f"#!{sys.executable}\n" + textwrap.dedent(PROGRAM.replace("STEP_MS", "100 * M"))),
                           ("bench_kernels", textwrap.dedent(STAND_INS["build/bench_kernels"]).replace("0.056", "0.070")
                            + 'echo "| fp8 transpose e5m2 grad [8192, 50304] x6 | 1.730 | 2.86 TB/s | 67.6% |"\n'
                            + 'echo "|   its fastest: candidate 1 | 0.200 | x |"\necho "|   its fastest: candidate 1 | 0.300 | x |"\n')):
            with open(os.path.join(baseline, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(baseline, name), 0o755)
        with open(os.path.join(baseline, "REVISION"), "w") as f:
            f.write("da7bc95f00000000000000000000000000000000\n")
        with open(os.path.join(self.repo, "build", "bench_kernels"), "a") as f:  # a row the baseline lacks
            f.write('echo "|   its fastest: candidate 1 | 0.100 | x |"\necho "| mix norm bwd | 0.150 | x |"\n')
        status, report, output = self.acceptance("anchor", "bench", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--attention flash-split")
        self.assertEqual(status, 0, output)
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertEqual([p.split()[0] for p in programs], ["train_gpt", "record_pytorch.py", "train_gpt", "train_gpt"])
        self.assertIn("--micro-batches 8 --num-iterations 20 --val-every 0", programs[3])  # the trainer's flags
        self.assertRegex(report, r"\| baseline da7bc95, M = 8 \| 20 \| \d+ \| 800.0 \|")
        self.assertIn("| M = 8, baseline da7bc95 | 800.0 | 785.0 | 1.019 |", report)
        self.assertIn("beside the baseline da7bc95 (below 1: faster now):\n\n| M | ours ms | baseline ms | ours / baseline |\n"
                      "|---|---|---|---|\n| M = 8 | 730.0 | 800.0 | 0.912 |", report)
        # the bench: only the rows both tables name once
        self.assertIn("### Beside the baseline da7bc95", report)
        self.assertIn("|---|---|---|---|\n| rmsnorm fwd [49152, 768] | 0.056 | 0.070 | 0.800 |\n", report)
        self.assertNotIn("| mix norm bwd |", report.split("### Beside the baseline")[1])
        self.assertNotIn("its fastest", report.split("### Beside the baseline")[1])
        # without a staging, neither runs
        shutil.rmtree(baseline)
        status, report, output = self.acceptance("anchor", "bench", gpus=1, ANCHOR_RUNS="8:20")
        self.assertEqual(status, 0, output)
        self.assertNotIn("baseline", report.split("## Machine")[-1])  # (the report goes on from call to call)

    def test_anchor_runs_choose_the_runs_and_a_malformed_one_is_refused_before_any_phase(self):
        status, report, output = self.acceptance("anchor", gpus=1, ANCHOR_RUNS="8:20",
                                                 ANCHOR_VARIANTS="--attention flash-split")
        self.assertEqual(status, 0, output)
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertEqual([p.split()[0] for p in programs], ["train_gpt", "record_pytorch.py", "train_gpt"])
        self.assertIn("| M = 8, ours --attention flash-split | 730.0 | 785.0 | 0.930 |", report)
        self.assertNotIn("M = 1", report)
        for bad in ("8 20", "8:0", "x:20", "8:20,1:60", "  "):
            status, _, output = self.acceptance("anchor", gpus=1, ANCHOR_RUNS=bad)
            self.assertEqual(status, 2, bad)
            self.assertIn("error: ANCHOR_RUNS = ", output)

    def test_the_anchor_phase_fails_without_a_corpus_or_with_a_failed_run(self):
        os.remove(os.path.join(self.repo, "corpus-bin", "corpus_train_000001.bin"))
        status, report, _ = self.acceptance("anchor", gpus=1)
        self.assertEqual(status, 1)
        self.assertIn("No corpus: corpus-bin/ is empty and .carry/corpus/ did not unpack", report)
        open(os.path.join(self.repo, "corpus-bin", "corpus_train_000001.bin"), "w").close()
        with open(os.path.join(self.repo, "tools", "record_pytorch.py"), "a") as f:
            f.write("sys.exit(4)\n")
        status, report, _ = self.acceptance("anchor", gpus=1)
        self.assertEqual(status, 1)
        self.assertRegex(report, r"\| record, M = 8 \| 20 \| \d+ \| FAILED: exit 4 \(anchor/record_M8/console.txt\) \|")
        self.assertIn("| M = 8 | 730.0 | failed | - |", report)  # its log was written, but it failed
        os.remove(os.path.join(self.repo, ".carry", "anchor", "train_gpt.py"))
        status, report, _ = self.acceptance("anchor", gpus=1)
        self.assertEqual(status, 1)
        self.assertIn("No record code: neither ANCHOR_RECORD", report)

    def test_the_profile_phase_tables_each_programs_kernels_and_the_counters(self):
        status, report, output = self.acceptance("profile", gpus=1)
        self.assertEqual(status, 0, output)
        self.assertIn("### ours: step 5's own line: 730.0 ms\n", report)
        self.assertIn("### record: step 5's own line: 785.0 ms\n", report)
        self.assertIn("| 0 | 730.00 | 657.00 | 657.00 | 0.900 | 3 |", report)
        self.assertIn("| `flash::backward_dkv_kernel` | 2 | 547.500 | 273750.0 | 75.0% |", report)
        self.assertIn("| `softcap_cross_entropy_kernel` | 1 | 600 | 75 |", report)
        programs = self.read(self.calls + ".programs").splitlines()
        self.assertIn("--num-iterations 6", programs[0])
        self.assertTrue(programs[0].endswith("--profile-step 5"), programs[0])
        self.assertIn("ncu --clock-control none --profile-from-start off", self.commands())
        status, report, _ = self.acceptance("profile", gpus=1, FAKE_NCU="fail")
        self.assertEqual(status, 0)  # counters are read where the machine allows
        self.assertIn("ncu gave no counters (exit 1): ==ERROR== ERR_NVGPUCTRPERM: no permission", report)

    def test_a_profile_without_a_range_fails_the_phase(self):
        with open(os.path.join(self.repo, "build", "train_gpt"), "a") as f:
            f.write("os.remove(os.environ['KERNEL_PROFILE_OUT']) if '--profile-step' in args else None\n")
        status, report, _ = self.acceptance("profile", gpus=1, FAKE_NCU="fail")
        self.assertEqual(status, 1)
        self.assertIn("No profile: error: ", report)
        self.assertIn("kernels.csv", report)

    def test_a_diloco_run_whose_ranks_disagree_fails_the_nccl_phase(self):
        status, report, output = self.acceptance("nccl", gpus=2, FAKE_RUN_FAILS="diloco:2")
        self.assertEqual(status, 1, output)
        self.assertIn("| 2 | 1 | 0 | FAILED (exit 1: error: ranks disagree on parameter embed.weight", report)

    def test_a_second_call_continues_the_report(self):
        self.acceptance("tests", gpus=1)
        status, report, _ = self.acceptance("bench", gpus=1)
        self.assertEqual(status, 0)
        self.assertEqual(report.count("## Machine "), 2)
        self.assertLess(report.index("**tests: passed**"), report.index("## bench"))

    @unittest.skipUnless(shutil.which("shellcheck"), "shellcheck is not installed")
    def test_the_script_is_shellcheck_clean(self):
        result = subprocess.run(["shellcheck", SCRIPT, os.path.join(ROOT, "tools", "stage_build.sh")],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout)


if __name__ == "__main__":
    unittest.main()
