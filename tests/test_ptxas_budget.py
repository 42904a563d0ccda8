"""Every kernel of the trainer compiles for sm_90a without spilling registers, without a stack frame
and without a ptxas warning, so that the register budgets the kernels were designed to (docs/PERF.md:
the flash and warp-specialised kernels, our GEMM) hold without a GPU: a spill, an array indexed at
run time that ptxas keeps in local memory (a stack frame), a wgmma serialised for want of registers
(C7512) or a setmaxnreg ptxas ignored (C7508) fails CI instead of a benchmark months later.

  python3 tests/test_ptxas_budget.py                      the parser's own tests (canned ptxas output)
  python3 tests/test_ptxas_budget.py --compile NVCC FLAGS... SOURCE
                                                          compiles SOURCE to a cubin with -Xptxas -v,
                                                          prints each kernel's registers, spills and
                                                          shared memory; exit 1 on a spill or a warning
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")
# Kernels whose stack frame is by design: the simulated ranks' sum reads its by-value table of rank
# buffers at run-time indices (tests and one-GPU oracles only, never a run's hot path).
STACK_FRAME_ALLOWED = ("sum_rank_buffers_kernel",)


def kernels_and_problems(ptxas_output):
    """({kernel: [registers, spill stores, spill loads, static smem]}, [problem lines]). A spill is
    a problem in any function ptxas reports (a kernel or a device function it did not inline)."""
    kernels, problems, entry, function = {}, [], None, None
    for line in ptxas_output.splitlines():
        if m := ENTRY.search(line):
            entry = m.group(1)
            kernels[entry] = [0, 0, 0, 0]
        elif m := PROPERTIES.search(line):
            function = m.group(1)
        elif "warning" in line.lower():
            problems.append(line.strip())
        elif function and (m := SPILLS.search(line)):
            frame, stores, loads = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if function in kernels:
                kernels[function][1:3] = [stores, loads]
            if stores or loads:
                problems.append(f"{function}: {stores} bytes spill stores, {loads} bytes spill loads")
            elif frame and function in kernels and not any(a in function for a in STACK_FRAME_ALLOWED):
                problems.append(f"{function}: {frame} bytes stack frame (an array indexed at run time, in local memory)")
        elif entry and (m := USED.search(line)):
            kernels[entry][0] = int(m.group(1))
            kernels[entry][3] = int(m.group(2) or 0)
    return kernels, problems


def without_parameters(name):
    """A demangled name less its parameter list (the parentheses that close it)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += name[i] == ")"
        depth -= name[i] == "("
        if depth == 0:
            return name[:i]
    return name


def demangled(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def compile_and_check(command):
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(command + ["-cubin", "-Xptxas", "-v", "-o", os.path.join(folder, "kernels.cubin")],
                                capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout + result.stderr)
        print(f"error: the compile failed (exit {result.returncode})")
        return 1
    kernels, problems = kernels_and_problems(result.stderr + result.stdout)
    if not kernels:
        print("error: ptxas reported no kernel: nothing was checked")
        return 1
    names = demangled(list(kernels))
    print("| kernel | registers | spill stores / loads | static smem |")
    print("|---|---|---|---|")
    for name, (registers, stores, loads, smem) in sorted(kernels.items(), key=lambda kv: names[kv[0]]):
        short = without_parameters(names[name])
        print(f"| `{short[:110]}` | {registers} | {stores} / {loads} | {smem} |")
    print(f"{len(kernels)} kernels")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


CLEAN = """ptxas info    : Compiling entry function '_Z3addPf' for 'sm_90a'
ptxas info    : Function properties for _Z3addPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z4copyPf' for 'sm_90a'
ptxas info    : Function properties for _Z4copyPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]
"""


class ParserTest(unittest.TestCase):
    def test_clean_output_has_no_problem(self):
        kernels, problems = kernels_and_problems(CLEAN)
        self.assertEqual(kernels, {"_Z3addPf": [168, 0, 0, 128], "_Z4copyPf": [12, 0, 0, 0]})
        self.assertEqual(problems, [])

    def test_names_lose_their_parameters_only(self):
        self.assertEqual(without_parameters("void k<(L)0, E>(CUtensorMap_st, int)"), "void k<(L)0, E>")
        self.assertEqual(without_parameters("plain"), "plain")

    def test_a_spill_is_a_problem(self):
        text = CLEAN.replace("0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 12",
                             "44 bytes spill stores, 44 bytes spill loads\nptxas info    : Used 12")
        _, problems = kernels_and_problems(text)
        self.assertEqual(problems, ["_Z4copyPf: 44 bytes spill stores, 44 bytes spill loads"])

    def test_a_device_function_spill_is_its_own(self):
        text = CLEAN.replace("ptxas info    : Compiling entry function '_Z4copyPf'",
                             "ptxas info    : Function properties for _Z6helperv\n"
                             "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
                             "ptxas info    : Compiling entry function '_Z4copyPf'")
        kernels, problems = kernels_and_problems(text)
        self.assertEqual(kernels["_Z3addPf"], [168, 0, 0, 128])
        self.assertEqual(problems, ["_Z6helperv: 8 bytes spill stores, 8 bytes spill loads"])

    def test_a_stack_frame_is_a_problem_but_where_allowed(self):
        text = CLEAN.replace("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 12",
                             "96 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 12")
        _, problems = kernels_and_problems(text)
        self.assertEqual(problems, ["_Z4copyPf: 96 bytes stack frame (an array indexed at run time, in local memory)"])
        allowed = text.replace("_Z4copyPf", "_Z23sum_rank_buffers_kernelIfEv11RankBuffersimPT_mf")
        self.assertEqual(kernels_and_problems(allowed)[1], [])

    def test_a_warning_is_a_problem(self):
        warning = ("ptxas warning : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
                   "serialized due to insufficient register resources for the wgmma pipeline in the function "
                   "'_Z3addPf'")
        _, problems = kernels_and_problems(CLEAN + warning + "\n")
        self.assertEqual(problems, [warning])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--compile":
        sys.exit(compile_and_check(sys.argv[2:]))
    unittest.main()
