#!/usr/bin/env python3
"""Copies the sources the GPU tests compile into OUT, rewritten so that a C++ compiler builds them
against the CPU emulator (cuda_emulator.h, force-included):

  kernel<<<grid, block, smem, stream>>>(args)  ->  ::emu::launch(::emu::LaunchConfig(grid, ...), &kernel,
                                                   [](auto... emu_args) { kernel(emu_args...); }, args)
  extern __shared__ [__align__(n)] T name[];  ->  T* name = ::emu::dynamic_shared<T>();
  __shared__ [__align__(n)] T a[N], b;         ->  auto& a = ::emu::static_shared<T[N]>(n, [] {});
                                                   auto& b = ::emu::static_shared<T>(n, [] {});
  kernels/ptx.cuh                              ->  tests/emulator/ptx.cuh (the instructions on the CPU)
  reinterpret_cast<T*>(p) in kernels/          ->  ::emu::aligned_cast<T*>("T*", p) (refuses a pointer
                                                   less aligned than T, where the GPU faults)
  cudaLaunchKernelEx(config, kernel, args)     ->  ::emu::launch_kernel_ex(config, kernel, args)
                                                   (kernels/host/launch.cuh's launch_kernel)

Each static __shared__ variable becomes a place in the block's static shared memory (the empty
lambda makes each declaration a distinct template instance, hence a distinct place), which the
emulator poisons as each block starts and counts against the GPU's limits.
The call goes through a generic lambda so that a kernel template's arguments are deduced from the
launch's arguments, as <<<>>> does; such a kernel's address (for the limits that
cudaFuncSetAttribute sets) is then unknown and passed as null.
The kernels reach 4-, 8- and 16-byte vectors (Bf16x8, float4, uint2, a bf16 pair as a word) through
reinterpret_cast; a GPU faults on such an access at an address that is not a multiple of its size,
a CPU does not, so the emulator checks every cast to a pointer in kernels/ (the kernels themselves
stay free of emulator code).
Top-level test sources (tests/gpu/test_*.cu, and the emulator's own tests/emulator/test_*.cu) are
written as .cpp; everything else keeps its name and path, so #include lines resolve inside OUT.
The SUITEs named (tests/gpu test files that include the whole trainer) are also written together as
one program, OUT/tests/emulator/trainer_suites.cpp, so that the trainer (most of each one's compile)
compiles once: their #include lines first, at global scope (each suite's own #includes are then
already done), then each suite's source in a namespace of its own, so that the names it keeps to
itself do not meet another suite's. Its first argument names the suite to run (run_gpu_suites).
Usage: translate.py [--list] SOURCE_ROOT OUT_ROOT [SUITE...] (--list: print the files it would
write, ';'-separated)
"""
import pathlib
import re
import sys

# What a kernel name may look like before <<<: a qualified identifier with optional template
# arguments (one level of nesting).
KERNEL = r"[A-Za-z_][\w:]*(?:<[^<>;{}()]*(?:<[^<>;{}()]*>[^<>;{}()]*)*>)?"
LAUNCH = re.compile(r"(" + KERNEL + r")\s*<<<(.*?)>>>\s*\((\s*\))?", re.S)
LAUNCH_EX = re.compile(r"\bcudaLaunchKernelEx\(")
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
STATIC_SHARED = re.compile(r"^(\s*)__shared__\s+(?:__align__\(\s*(\d+)\s*\)\s+)?([\w:]+)\s+([^;]+);", re.M)
DECLARATOR = re.compile(r"\s*(\w+)\s*((?:\[[^\]]*\])*)\s*$")
TEMPLATE_KERNEL = re.compile(r"template\s*<[^;{]*?>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(")
POINTER_CAST = re.compile(r"reinterpret_cast<\s*([^<>;()]*?\*)\s*>\s*\(")
SOURCES = ["train_gpt.cu", "kernels/*", "kernels/host/*", "data/*.h", "tests/*.h", "tests/gpu/*",
           "tests/reference/*", "tests/emulator/test_*.cu"]
TEST_FOLDERS = ("tests/gpu", "tests/emulator")


def check_pointer_casts(text):
    return POINTER_CAST.sub(lambda m: f'::emu::aligned_cast<{m.group(1)}>("{m.group(1)}", ', text)


def static_shared(m):
    indent, alignment, element, declarators = m.group(1), m.group(2) or "0", m.group(3), m.group(4)
    places = []
    for declarator in declarators.split(","):
        name, extents = DECLARATOR.match(declarator).groups()
        places.append(f"auto& {name} = ::emu::static_shared<{element}{extents}>({alignment}, [] {{}});")
    return indent + " ".join(places)


def rewrite(text, template_kernels):
    def launch(m):
        kernel, config, empty_args = m.group(1), " ".join(m.group(2).split()), m.group(3)
        deduced = kernel.split("::")[-1] in template_kernels
        address = "nullptr" if deduced else f"reinterpret_cast<const void*>(&{kernel})"
        head = f"::emu::launch(::emu::LaunchConfig({config}), {address}, [](auto... emu_args) {{ {kernel}(emu_args...); }}"
        return head + ")" if empty_args else head + ", "

    text = LAUNCH.sub(launch, text)
    text = LAUNCH_EX.sub("::emu::launch_kernel_ex(", text)
    text = EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ::emu::dynamic_shared<{m.group(1)}>();", text)
    return STATIC_SHARED.sub(static_shared, text)


def targets(source_root, out_root):
    """(source, target) of every file translated: what the rewrite reads and where it writes."""
    paths = [p for pattern in SOURCES for p in sorted(source_root.glob(pattern))
             if p.is_file() and p.suffix in (".cu", ".cuh", ".h")]
    pairs = []
    for path in paths:
        relative = path.relative_to(source_root)
        if relative.as_posix() == "kernels/ptx.cuh":
            path = source_root / "tests/emulator/ptx.cuh"
        target = relative
        if relative.parent.as_posix() in TEST_FOLDERS and relative.name.startswith("test_"):
            target = relative.with_suffix(".cpp")
        pairs.append((path, relative, out_root / target))
    return pairs


INCLUDE = re.compile(r"^#include\s+[<\"].*$", re.M)
SUITES_PROGRAM = "tests/emulator/trainer_suites.cpp"


def suites_program(suites, texts):
    """The one program of `suites`, given each one's translated source."""
    includes = list(dict.fromkeys(line for suite in suites for line in INCLUDE.findall(texts[suite])))
    lines = ["// Written by tests/emulator/translate.py (its docstring says why): the suites "
             + ", ".join(suites) + " as one program.", *includes, ""]
    for suite in suites:
        lines += [f"namespace suite_{suite} {{", f'#include "gpu/{suite}.cpp"', f"}}  // namespace suite_{suite}", ""]
    lines.append("int main(int argc, char** argv) { return run_gpu_suites(argc, argv); }")
    return "\n".join(lines) + "\n"


def write_if_changed(target, text):
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists() or target.read_text() != text:  # unchanged files keep their time stamps
        target.write_text(text)


def main(source_root, out_root, suites, list_only):
    source_root, out_root = pathlib.Path(source_root), pathlib.Path(out_root)
    pairs = targets(source_root, out_root)
    if list_only:  # for CMake: every file written, so that a build knows what the rewrite changes
        written = [target.as_posix() for _, _, target in pairs]
        print(";".join(written + ([(out_root / SUITES_PROGRAM).as_posix()] if suites else [])))
        return
    template_kernels = {name for path, _, _ in pairs for name in TEMPLATE_KERNEL.findall(path.read_text())}
    suite_texts = {}
    for path, relative, target in pairs:
        text = path.read_text()
        if relative.parts[0] == "kernels":
            text = check_pointer_casts(text)  # before the launches add casts of kernel addresses
        text = rewrite(text, template_kernels)
        write_if_changed(target, text)
        if relative.parent.as_posix() == "tests/gpu" and relative.stem in suites:
            suite_texts[relative.stem] = text
    if suites:
        missing = [suite for suite in suites if suite not in suite_texts]
        if missing:
            sys.exit(f"translate.py: no tests/gpu/<suite>.cu for {', '.join(missing)}")
        write_if_changed(out_root / SUITES_PROGRAM, suites_program(suites, suite_texts))


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--list"]
    if len(arguments) < 2:
        sys.exit(__doc__)
    main(arguments[0], arguments[1], arguments[2:], "--list" in sys.argv[1:])
