#!/usr/bin/env python3
"""Where a profiled range's time went, kernel by kernel, from tools/kernel_profile.cpp's file.

  python3 tools/profile_summary.py profile.csv [--top N] [--full-names]

Prints, per range (one --profile-step is one range), its wall time, the sum of its kernels'
times, and the time the GPU was busy with any of them (their union: kernels on two streams that
overlap count once); then one table of kernel names over all ranges, per range: calls, total ms,
mean us and share of the wall time, largest first, copies and memsets as rows of their own.
Names are shortened to what tells kernels apart: the function without its return type,
parameters and template arguments (CUTLASS's device_kernel keeps its first argument, which names
the real kernel; our gemm_epilogue::gemm_kernel its last, the epilogue, which names the product);
--full-names keeps them whole. Exit status 1: a file that cannot be a
measurement (no range, a range never closed, records CUPTI dropped).

  python3 tools/profile_summary.py --ncu ncu_raw.csv

tables the hardware counters that say what holds a kernel back (tensor pipe, issue slots, barrier
and long-scoreboard stalls, LSU wavefronts, DRAM, the XU/MUFU pipe), per kernel name, from
`ncu --csv --page raw` output with the SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats,
MemoryWorkloadAnalysis and SchedulerStats sections."""
import argparse
import csv
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline_summary import busy_time  # noqa: E402


class ProfileError(Exception):
    pass


def read_profile(path):
    """(ranges [(start, end)], records [(kind, start, end, stream, name)]) in ns."""
    ranges, records, dropped = [], [], 0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            kind, _, rest = line.partition(",")
            try:
                if kind == "range":
                    _, start, end = rest.split(",")
                    ranges.append((int(start), int(end)))
                elif kind in ("kernel", "memcpy", "memset"):
                    start, end, stream, name = rest.split(",", 3)
                    records.append((kind, int(start), int(end), int(stream), name))
                elif kind == "dropped":
                    dropped = int(rest)
                else:
                    raise ValueError(f"unknown record '{kind}'")
            except ValueError as e:
                raise ProfileError(f"{path}:{number}: not a kernel_profile line ({e}): {line[:120]}")
    if not ranges:
        raise ProfileError(f"{path}: no profiled range: the program never called cudaProfilerStart "
                           "(the trainer's --profile-step, record_pytorch.py's --profile-step)")
    if any(end == 0 for _, end in ranges):
        raise ProfileError(f"{path}: a range was never closed (no cudaProfilerStop): its end is unknown")
    if dropped:
        raise ProfileError(f"{path}: CUPTI dropped {dropped} records: the kernel times are incomplete")
    return ranges, records


def short_name(kind, name, full=False):
    if kind != "kernel":
        return f"[{kind} {name.split(',')[0]}]"
    if full:
        return name
    base = name
    if base.startswith("void "):
        base = base[5:]
    depth, cut = 0, len(base)
    for i, c in enumerate(base):  # the parameter list: the first '(' outside template brackets
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            cut = i
            break
    base = base[:cut]
    if "<" in base:
        head, args = base[:base.index("<")], base[base.index("<") + 1:]
        if head.endswith("gemm_epilogue::gemm_kernel"):  # <layout, epilogue>: the epilogue names the product
            depth, start = 0, 0
            for i, c in enumerate(args[:-1]):
                depth += c == "<"
                depth -= c == ">"
                if c == "," and depth == 0:
                    start = i + 1
            base = f"{head}<{args[start:-1].strip().split('::')[-1]}>"
        elif head.endswith("device_kernel") or head.endswith("::Kernel") or head.endswith("::Kernel2"):
            depth, end = 0, len(args)
            for i, c in enumerate(args):
                depth += c == "<"
                depth -= c == ">"
                if depth < 0 or (c == "," and depth == 0):
                    end = i
                    break
            base = args[:end]
        else:
            base = head
    return base if len(base) <= 100 else base[:97] + "..."


def summarise(ranges, records, full=False):
    """Per range (wall, sum, busy, records) in ns, and per name [calls, total ns] summed over the ranges."""
    per_range = []
    names = defaultdict(lambda: [0, 0])
    for start, end in ranges:
        inside = [r for r in records if start <= r[1] <= end]
        per_range.append((end - start, sum(r[2] - r[1] for r in inside), int(busy_time([(r[1], r[2]) for r in inside])),
                          len(inside)))
        for kind, s, e, _, name in inside:
            row = names[short_name(kind, name, full)]
            row[0] += 1
            row[1] += e - s
    return per_range, names


# The hardware counters that say what holds a kernel back, by their names in ncu's raw page (the
# SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats, MemoryWorkloadAnalysis and SchedulerStats
# sections collect them; read on an H200 with Nsight Compute 2025.3).
NCU_METRICS = (("time us", "gpu__time_duration.sum"),
               ("SM throughput %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
               ("tensor pipe active %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
               ("issue active %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
               ("barrier stall / issue", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"),
               ("long-scoreboard stall / issue",
                "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"),
               ("LSU wavefronts %", "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed"),
               ("DRAM throughput %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
               ("XU (MUFU) pipe %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"))


def ncu_table(path):
    """ncu --csv --page raw output: per kernel name, the mean of each metric NCU_METRICS names."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    rows = list(csv.reader(lines))
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise ProfileError(f"{path}: not ncu's raw CSV (no 'Kernel Name' column, or no kernel row)")
    header, units, kernels = rows[0], rows[1], rows[2:]
    name_col = header.index("Kernel Name")
    columns = [(label, header.index(metric)) for label, metric in NCU_METRICS if metric in header]
    if not columns:
        raise ProfileError(f"{path}: none of the metrics {[m for _, m in NCU_METRICS]} was collected")
    values = defaultdict(lambda: defaultdict(list))
    for row in kernels:
        name = short_name("kernel", row[name_col])
        for _, i in columns:
            try:
                value = float(row[i].replace(",", ""))
            except ValueError:
                continue
            if header[i] == "gpu__time_duration.sum":  # to microseconds, whatever unit ncu chose
                value *= {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(units[i], 1e-3)
            values[name][i].append(value)
    out = ["| kernel | launches | " + " | ".join(label for label, _ in columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
    for name, by_column in values.items():
        launches = max(len(v) for v in by_column.values())
        cells = [f"{sum(by_column[i]) / len(by_column[i]):.4g}" if by_column[i] else "" for _, i in columns]
        out.append(f"| `{name}` | {launches} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", help="the file KERNEL_PROFILE_OUT named (with --ncu: ncu's raw CSV)")
    parser.add_argument("--top", type=int, default=0, help="only the N largest rows (0: all)")
    parser.add_argument("--full-names", action="store_true", help="group by the whole demangled name")
    parser.add_argument("--ncu", action="store_true",
                        help="the file is `ncu --csv --page raw` output: table its counters per kernel name")
    args = parser.parse_args(argv)
    if args.ncu:
        try:
            print(ncu_table(args.profile))
        except (OSError, ProfileError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        ranges, records = read_profile(args.profile)
    except (OSError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    per_range, names = summarise(ranges, records, args.full_names)
    n = len(ranges)
    print("| range | wall ms | kernels' sum ms | GPU busy ms | sum / wall | records |\n|---|---|---|---|---|---|")
    for i, (wall, total, busy, count) in enumerate(per_range):
        print(f"| {i} | {wall / 1e6:.2f} | {total / 1e6:.2f} | {busy / 1e6:.2f} | {total / wall:.3f} | {count} |")
    wall = sum(w for w, _, _, _ in per_range) / n
    rows = sorted(names.items(), key=lambda item: -item[1][1])
    if args.top:
        rows = rows[:args.top]
    print(f"\nPer range (the mean of {n}), largest first; share: of the range's wall time, {wall / 1e6:.2f} ms.\n")
    print("| kernel | calls | total ms | mean us | share |\n|---|---|---|---|---|")
    for name, (calls, total) in rows:
        name = name.replace("|", "\\|")
        print(f"| `{name}` | {calls / n:g} | {total / n / 1e6:.3f} | {total / calls / 1e3:.1f} | "
              f"{100 * total / n / wall:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
