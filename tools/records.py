#!/usr/bin/env python3
"""Records of the speedrun: frozen single-file trainers, the statistics of their run logs, the
comparison of runs with a record's, and the generated record tables. Standard library only, but for
the plots (--png), which need matplotlib.

  records.py freeze NAME [--date YYYY-MM-DD] [--target 3.28] [--from-log LOG...]
                                                              new records/<date>_<NAME>/
  records.py inline OUTPUT                                    the single-file trainer only
  records.py stats LOG|DIR... [--against LOG|DIR...] [--target X] [--png FILE]
  records.py compare OURS... RECORD [--png FILE] [--label NAME...] [--target X]
  records.py table [--check]                                  regenerate the README tables
"""
import argparse
import datetime
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINEWEB_TARGET = 3.28  # the community rule: mean final val loss < 3.28 at p < 0.01
SIGNIFICANCE = 0.01
BUILD_COMMAND = ("nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr "
                 "-o train_gpt train_gpt.cu -lcublasLt -lcublas -lcusolver -lnccl")
TABLE_BEGIN, TABLE_END = "<!-- records:begin -->", "<!-- records:end -->"
RECORD_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}_[A-Za-z0-9][A-Za-z0-9_.-]*")
TARGET_LINE = re.compile(r"^Target val loss: ([0-9]+(?:\.[0-9]+)?)\.?[ \t]*$", re.M)  # a sentence's full stop may follow
NO_RUNS = "No runs yet.\n"


class RecordError(Exception):
    """A refusal: names the file and the reason; the command exits non-zero."""


# ------------------------------------------------------------------------------------------------
# Run logs. Both our logs and the reference's: the source, a rule of 100 '=', the environment, a
# rule, then step lines; a bare step-line file has no rule. Only whole lines after the last rule
# that match a step pattern exactly are measurements, so source text never is.
# ------------------------------------------------------------------------------------------------
LOG_RULE = "=" * 100
NUMBER = r"-?(?:\d+(?:\.\d+)?|nan|inf)"
VAL_LINE = re.compile(rf"step:(\d+)/(\d+) val_loss:({NUMBER}) train_time:(\d+)ms step_avg:{NUMBER}ms")
TRAIN_LINE = re.compile(rf"step:(\d+)/(\d+) train_time:(\d+)ms step_avg:{NUMBER}ms")
FALLBACK_LINE = "self-check fallback: "
# The trainer's line when --resume continued a run: what differed from the run that wrote the
# checkpoint follows the step (", with other settings: ..." and "; its steps before ran other kernels: ...").
RESUMED_LINE = re.compile(r"resumed from (.+?\.ckpt) at step (\d+)"
                          r"(?: \(the newest step every rank holds[^)]*\))?"  # an older step than some rank's newest
                          r"((?:, with other settings: .*?)?(?:; its steps before ran other kernels: .*)?)")


SETTING_LINE = re.compile(r"setting: ([a-z0-9-]+)=(.*)")
SHARD_LINE = re.compile(r"shard: ([a-z-]+) (.+) (\d+) bytes, token hash ([0-9a-f]{16})")
# Flags that change neither what a run computes nor how fast: runs that differ only in them pool.
POOLABLE_FLAGS = {"seed", "checkpoint-dir", "log-dir", "resume", "stall-timeout", "self-check"}
DATA_FLAGS = {"train-files", "val-files"}  # compared by the shards they matched, not by the globs' text


@dataclass
class Run:
    path: str
    num_iterations: int = 0
    val: list = field(default_factory=list)    # (step, val loss, train ms) at validation steps
    train: list = field(default_factory=list)  # (step, train ms) after training steps
    fallbacks: list = field(default_factory=list)  # the header's "self-check fallback: ..." lines
    source: str = ""  # the text before the first rule: the source the run was built from
    settings: dict = field(default_factory=dict)  # flag -> exact value, from the header's setting: lines
    shards: list = field(default_factory=list)  # (flag, size in bytes, token hash) of every shard read
    header: dict = field(default_factory=dict)  # command, build, ranks, gpu lines of the header
    resumed: tuple = None  # (step, what differed: "" or the trainer's words) where --resume continued a run

    def final(self):
        """(val loss, train ms) of the final step:N/N val_loss line, or None if the run did not finish."""
        last = [(loss, ms) for step, loss, ms in self.val if step == self.num_iterations]
        return last[-1] if last else None

    def data(self):
        """What the run trained on, by the shards' file names: 'FineWeb', the names, or None if unrecorded."""
        names = sorted(os.path.basename(path) for flag, path, _, _ in self.shards if flag == "train-files")
        if not names:
            return None
        return "FineWeb" if all(n.startswith("fineweb_train_") for n in names) else ", ".join(names[:3]) + (
            ", ..." if len(names) > 3 else "")


def parse_log(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rules = [i for i, line in enumerate(lines) if line == LOG_RULE]
    run = Run(path)
    if rules:
        run.source = "\n".join(lines[:rules[0]]) + "\n"
    # The trainer's header (after the source's rule): what made the run, and every fast path its
    # self-check replaced.
    header_end = rules[1] if len(rules) >= 2 else len(lines)
    for line in lines[rules[0] + 1 if rules else 0:header_end]:
        if line.startswith(FALLBACK_LINE):
            run.fallbacks.append(line)
        elif m := SETTING_LINE.fullmatch(line):
            run.settings[m[1]] = m[2]
        elif m := SHARD_LINE.fullmatch(line):
            run.shards.append((m[1], m[2], int(m[3]), m[4]))
        elif (key := line.split(": ", 1)[0]) in ("command", "build", "ranks", "gpu") and ": " in line:
            run.header[key] = line.split(": ", 1)[1]
    for line in lines[rules[0] + 1 if rules else 0:]:
        if m := RESUMED_LINE.fullmatch(line):
            run.resumed = (int(m[2]), m[3].lstrip(",; "))
    targets = set()
    for line in lines[rules[-1] + 1 if rules else 0:]:
        if m := VAL_LINE.fullmatch(line):
            run.val.append((int(m[1]), float(m[3]), int(m[4])))
        elif m := TRAIN_LINE.fullmatch(line):
            run.train.append((int(m[1]), int(m[3])))
        else:
            continue
        targets.add(int(m[2]))
    if not targets:
        raise RecordError(f"{path}: no step lines (not a run log?)")
    if len(targets) > 1:
        raise RecordError(f"{path}: step lines mix num_iterations {sorted(targets)}")
    run.num_iterations = targets.pop()
    return run


def log_files(paths):
    """The .txt logs named, or found directly inside the folders named, in a stable order."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".txt"))
        else:
            files.append(path)
    if not files:
        raise RecordError(f"{', '.join(paths)}: no .txt logs")
    return files


def finished_runs(paths):
    """Parsed runs of one set, refused unless each finished with a finite loss and all share N."""
    runs = [parse_log(f) for f in log_files(paths)]
    for run in runs:
        final = run.final()
        if final is None:
            last = max([s for s, _ in run.train] + [s for s, _, _ in run.val])
            if last == run.num_iterations:
                raise RecordError(f"{run.path}: reached step {last}/{run.num_iterations} but has no val_loss line "
                                  "there (a run that never validated at its end has no final loss)")
            raise RecordError(f"{run.path}: did not finish: no final step:{run.num_iterations}/"
                              f"{run.num_iterations} val_loss line (last step seen: {last})")
        if not math.isfinite(final[0]):
            raise RecordError(f"{run.path}: final val_loss is {final[0]}")
        if run.fallbacks:
            raise RecordError(f"{run.path}: trained on a reference path, not a record run: {run.fallbacks[0]}")
        if run.resumed and run.resumed[1]:
            raise RecordError(f"{run.path}: resumed at step {run.resumed[0]} from a run that differed ({run.resumed[1]}): "
                              "its steps ran two ways, so it pools with no other run")
    by_target = {}
    for run in runs:
        by_target.setdefault(run.num_iterations, []).append(run.path)
    if len(by_target) > 1:
        mix = "; ".join(f"{n} steps in {', '.join(files)}" for n, files in sorted(by_target.items()))
        raise RecordError(f"runs mix targets: {mix}")
    if differences := setting_differences(runs):
        raise RecordError(f"runs that differ pool into nothing: {differences[0]}")
    refuse_duplicates(runs)
    return runs


def setting_differences(runs):
    """Where runs that carry their settings differ in what made them, one text each: a flag's value
    (but the POOLABLE_FLAGS), the data read (shard sizes and token hashes, not paths: a glob may be
    written relative or absolute), the ranks. Runs whose logs carry no settings are not compared."""
    recorded = [run for run in runs if run.settings]

    def differing(what, value_of):
        values = {}
        for run in recorded:
            values.setdefault(value_of(run), []).append(os.path.basename(run.path))
        if len(values) < 2:
            return []
        return [f"{what}: " + "; ".join(f"{value} in {', '.join(files)}" for value, files in values.items())]

    found = []
    for flag in sorted({flag for run in recorded for flag in run.settings} - POOLABLE_FLAGS - DATA_FLAGS):
        found += differing(f"--{flag}", lambda run: run.settings.get(flag, "(not recorded)"))
    found += differing("the data read (shard sizes and token hashes)",
                       lambda run: " ".join(f"{flag}:{size}:{digest}" for flag, _, size, digest in run.shards))
    found += differing("the ranks", lambda run: run.header.get("ranks", "(not recorded)").split(", launcher ")[0])
    return found


def gpu_of(run):
    return run.header.get("gpu", "(GPU not recorded)")


def comparability_notes(runs):
    """What a reader of pooled statistics must know: logs that carry no settings (nothing was
    checked), train times pooled over several GPU models."""
    notes = []
    unrecorded = [os.path.basename(run.path) for run in runs if not run.settings]
    if unrecorded:
        notes.append(f"{', '.join(unrecorded)}: no settings in the log (an older trainer's, or another code's): "
                     "whether these runs share their flags and data is not checked")
    gpus = {}
    for run in runs:
        gpus.setdefault(gpu_of(run), []).append(run)
    if len(gpus) > 1:
        notes.append("train times pooled over GPU models: " + ", ".join(
            f"{gpu} ({len(r)} run{'s' if len(r) > 1 else ''})" for gpu, r in gpus.items()))
    return notes


def refuse_duplicates(runs):
    """Refuses a run counted twice, which the tests would take for two independent runs (one file
    named twice gave p = 0). The same file: the same inode, however named (twice, through a folder
    and directly, through a link). The same run: the same step lines. Our logs carry their run id
    only in their file name (logs/<run-id>.txt; the text begins with the source) and the
    reference's step-line files none, and a copy may be renamed, so a run is known by its
    measurements: two real runs never agree on every step's train time to the millisecond. This
    also catches a full log beside its step-line extract."""
    files, measurements = {}, {}
    for run in runs:
        info = os.stat(run.path)
        file_key, run_key = (info.st_dev, info.st_ino), (tuple(run.val), tuple(run.train))
        if file_key in files:
            raise RecordError(f"{files[file_key]} and {run.path}: the same file, named twice; each run counts once")
        if run_key in measurements:
            raise RecordError(f"{measurements[run_key]} and {run.path}: the same run (identical step lines); "
                              "each run counts once")
        files[file_key] = measurements[run_key] = run.path


# ------------------------------------------------------------------------------------------------
# Statistics: Student's t distribution through the regularised incomplete beta function. In the
# standard library, not scipy: these few lines agree with scipy 1.10 to 1e-15 on every p and t
# tried (and the tests hold them to closed forms and t-tables), while scipy would be a large
# dependency of the one command every record needs, on machines (the GPU hosts, CI) that may lack it.
# ------------------------------------------------------------------------------------------------
def incomplete_beta(a, b, x):
    """I_x(a, b) by Lentz's continued fraction (Numerical Recipes 6.4), on the side where it converges."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(b, a, 1.0 - x)
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < eps:
            break
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    return math.exp(log_front) * fraction / a


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom (df may be fractional)."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@dataclass
class Summary:
    n: int
    mean: float
    std: float  # sample standard deviation (n - 1); nan for one value


def summarize(values):
    return Summary(len(values), statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan)


def t_quantile(probability, df):
    """The t with P(T <= t) = probability, by bisection of the increasing t_cdf."""
    low, high = -1.0, 1.0
    while t_cdf(low, df) > probability:
        low *= 2
    while t_cdf(high, df) < probability:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2


def one_sample_less(s, target):
    """One-sided one-sample t-test of mean < target: (t, df, p), as scipy.stats.ttest_1samp(...,
    alternative='less'). Runs that all end at one loss are below the target, or not, for certain."""
    if s.n < 2:
        return math.nan, math.nan, math.nan
    t = (s.mean - target) / (s.std / math.sqrt(s.n)) if s.std > 0 else math.copysign(math.inf, s.mean - target)
    return t, s.n - 1, t_cdf(t, s.n - 1)


def upper_confidence_bound(s):
    """The one-sided (1 - SIGNIFICANCE) upper confidence bound of the mean: the mean is below a
    target at p < SIGNIFICANCE exactly when this bound is."""
    if s.n < 2:
        return math.nan
    return s.mean + t_quantile(1 - SIGNIFICANCE, s.n - 1) * s.std / math.sqrt(s.n)


def welch(a, b):
    """Welch's two-sided t-test of mean(b) != mean(a): (t, Welch-Satterthwaite df, p)."""
    if a.n < 2 or b.n < 2:
        return math.nan, math.nan, math.nan
    va, vb = a.std ** 2 / a.n, b.std ** 2 / b.n
    if va + vb == 0:
        return math.nan, math.nan, math.nan
    t = (b.mean - a.mean) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1))
    return t, df, 2 * min(t_cdf(t, df), 1 - t_cdf(t, df))


# ------------------------------------------------------------------------------------------------
# Markdown tables.
# ------------------------------------------------------------------------------------------------
def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def number(value, digits):
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def p_text(p):
    """A p-value to 4 decimals, or "< 1e-4" below them (0.0000 would read as impossible)."""
    return "< 1e-4" if p < 1e-4 else number(p, 4)


def loss_and_seconds(runs):
    """Summaries of the final val loss and of the train time in seconds."""
    return summarize([r.final()[0] for r in runs]), summarize([r.final()[1] / 1000 for r in runs])


def set_row(runs, target):
    loss, seconds = loss_and_seconds(runs)
    t, df, p = one_sample_less(loss, target)
    return [str(loss.n), str(runs[0].num_iterations), number(loss.mean, 5), number(loss.std, 5), number(t, 3),
            number(df, 0), p_text(p), significance(p), number(seconds.mean, 3), number(seconds.std, 3)]


def significance(p):
    return "n/a" if math.isnan(p) else "yes" if p < SIGNIFICANCE else "no"


def set_header(target):
    return ["runs", "steps", "val loss mean", "val loss std", f"t (mean < {target})", "df", "p",
            f"p < {SIGNIFICANCE}", "time mean (s)", "time std (s)"]


def runs_table(runs):
    return markdown(["log", "final val loss", "train time (s)"],
                    [[os.path.basename(r.path), f"{r.final()[0]:.4f}", f"{r.final()[1] / 1000:.3f}"] for r in runs])


def stats_report(runs, target, against=None, notes=()):
    report = "".join(f"note: {n}\n" for n in notes) + ("\n" if notes else "")
    if against is None:
        return report + runs_table(runs) + "\n" + markdown(set_header(target), [set_row(runs, target)])
    report += markdown(["set"] + set_header(target), [["A"] + set_row(runs, target), ["B"] + set_row(against, target)])
    rows = []
    quantities = zip(("val loss", "train time (s)"), loss_and_seconds(runs), loss_and_seconds(against), (5, 3))
    for name, a, b, digits in quantities:
        t, df, p = welch(a, b)
        rows.append([name, number(b.mean - a.mean, digits), number(t, 3), number(df, 2), p_text(p)])
    return report + "\nWelch's t-test, B against A (two-sided):\n\n" + markdown(
        ["quantity", "mean B - mean A", "t", "df", "p"], rows)


# ------------------------------------------------------------------------------------------------
# Comparison of runs with a record's run: step-aligned validation tables.
# ------------------------------------------------------------------------------------------------
def default_target(runs):
    """FineWeb's target for runs that trained on FineWeb; refused for runs whose logs name other data
    (FineWeb's 3.28 says nothing of them); assumed, with a note, where the logs do not say."""
    data = {run.data() for run in runs}
    others = sorted(d for d in data if d not in (None, "FineWeb"))
    if others:
        raise RecordError(f"these runs trained on {'; '.join(others)}, not FineWeb: FineWeb's target {FINEWEB_TARGET} "
                          "says nothing of them; give theirs with --target")
    if None in data:
        return FINEWEB_TARGET, [f"target {FINEWEB_TARGET}, FineWeb's, assumed: not every log says what its run "
                                "trained on (give another with --target)"]
    return FINEWEB_TARGET, []


def stats_target(given, paths, runs):
    """--target where given; else the target of the record folders among `paths` (their README's
    'Target val loss' line: all the same, or refused); else default_target's."""
    if given is not None:
        return given, []
    folders = {}
    for path in paths:
        if os.path.isfile(os.path.join(path, "README.md")) and (target := record_target(path, required=False)):
            folders[path] = target
    if len(set(folders.values())) > 1:
        raise RecordError("the record folders name different targets (" +
                          ", ".join(f"{path}: {t:g}" for path, t in folders.items()) + "): give one with --target")
    if folders:
        path, target = next(iter(folders.items()))
        return target, [f"target {target:g}, from {os.path.join(path, 'README.md')}"]
    return default_target(runs)


def aligned_validation(ours, record):
    """(step, our val loss, the record's, our train ms, the record's) at each validation step of both."""
    theirs = {step: (loss, ms) for step, loss, ms in record.val}
    rows = [(step, loss, theirs[step][0], ms, theirs[step][1]) for step, loss, ms in ours.val if step in theirs]
    if not rows:
        raise RecordError(f"{ours.path} and {record.path}: no validation step in common")
    return rows


def comparison_notes(ours, record):
    """Why a run and a record's run may not be comparable step for step: other step counts (other
    schedules), other data, other flags; and logs that do not say."""
    notes = []
    if ours.num_iterations != record.num_iterations:
        notes.append(f"ours runs {ours.num_iterations} steps, the record {record.num_iterations}: the schedules "
                     "differ, steps are compared by number only")
    data = (ours.data(), record.data())
    if None not in data and data[0] != data[1]:
        notes.append(f"ours trained on {data[0]}, the record on {data[1]}: their losses are not comparable")
    if not (ours.settings and record.settings):
        notes.append("settings not in both logs: whether the runs share flags and data is not checked")
    else:
        notes += [f"the runs differ in {d}" for d in setting_differences([ours, record])]
    if gpu_of(ours) != gpu_of(record):
        notes.append(f"ours ran on {gpu_of(ours)}, the record on {gpu_of(record)}: their times are of other GPUs")
    for who, run in (("ours", ours), ("the record's", record)):
        if run.fallbacks:
            notes.append(f"{who} trained on a reference path where the self-check refused a fast one: {run.fallbacks[0]}")
        if run.resumed and run.resumed[1]:
            notes.append(f"{who} resumed at step {run.resumed[0]} from a run that differed: {run.resumed[1]}")
    return notes


def set_differences(a, b):
    """What two sets of runs differ in: the settings of the first run of each that carries them, and
    the GPU models (the train times' t-test compares machines as much as code where they differ)."""
    first = [next((run for run in runs if run.settings), None) for runs in (a, b)]
    notes = [f"A and B differ in {d}" for d in setting_differences(first)] if None not in first else []
    gpus = [sorted({gpu_of(run) for run in runs}) for runs in (a, b)]
    if gpus[0] != gpus[1]:
        notes.append(f"A ran on {', '.join(gpus[0])}, B on {', '.join(gpus[1])}: the train times' test compares "
                     "GPUs too")
    return notes


def final_comparison(ours, record):
    """Each run's last validation, whatever its step: the one comparison of runs of other lengths."""
    (step, loss, ms), (their_step, their_loss, their_ms) = ours.val[-1], record.val[-1]
    return (f"final: ours {loss:.4f} at step {step} in {ms / 1000:.1f} s, the record {their_loss:.4f} at step "
            f"{their_step} in {their_ms / 1000:.1f} s: {loss - their_loss:+.4f}, {(ms - their_ms) / 1000:+.1f} s")


def comparison_table(ours, record, label=None):
    rows = [[str(step), f"{loss:.4f}", f"{their_loss:.4f}", f"{loss - their_loss:+.4f}",
             str(ms), str(their_ms), f"{ms - their_ms:+d}"]
            for step, loss, their_loss, ms, their_ms in aligned_validation(ours, record)]
    notes = "".join(f"note: {n}\n" for n in comparison_notes(ours, record))
    name = f"{label} ({ours.path})" if label else ours.path
    return f"{name} against the record {record.path}:\n\n" + notes + (
        "\n" if notes else "") + markdown(
        ["step", "ours val loss", "record val loss", "delta loss", "ours time (ms)", "record time (ms)",
         "delta time (ms)"], rows) + "\n" + final_comparison(ours, record) + "\n"


# ------------------------------------------------------------------------------------------------
# Plots (--png): a matplotlib Figure on the Agg canvas, which writes files and needs no display.
# matplotlib is imported only here, so that every command without a plot runs without it.
# ------------------------------------------------------------------------------------------------
LOSS_RESOLUTION = 0.001  # a val loss difference the plots must show: the logs print 4 decimals


def new_figure(**options):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RecordError(f"the plots need matplotlib, which {sys.executable} lacks: install it with "
                          "`apt-get install python3-matplotlib` (Debian, Ubuntu: for /usr/bin/python3) "
                          "or `pip install matplotlib`") from None
    figure = Figure(layout="constrained", **options)
    FigureCanvasAgg(figure)
    return figure


def log_loss_axis(axes):
    """Log-scaled val loss labelled with plain numbers (matplotlib's own labels read 3x10^0)."""
    from matplotlib import ticker
    axes.set_yscale("log")
    axes.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)))
    axes.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_ylabel("val loss (log scale)")


def loss_difference_axis(axes, differences):
    """Linear with a grid line every LOSS_RESOLUTION while every difference is within ten of them;
    beyond, symlog, linear within one LOSS_RESOLUTION, so that a late 0.001 stays visible beside an
    early 0.1."""
    from matplotlib import ticker
    largest = max(abs(d) for d in differences)
    if largest > 10 * LOSS_RESOLUTION:
        axes.set_yscale("symlog", linthresh=LOSS_RESOLUTION)
        axes.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        axes.margins(y=0.08)
        axes.set_ylabel(f"val loss difference, > 0: higher\n(linear within ±{LOSS_RESOLUTION:g}, log beyond)")
    else:
        half_height = 1.15 * max(largest, 2 * LOSS_RESOLUTION)
        axes.set_ylim(-half_height, half_height)
        axes.yaxis.set_minor_locator(ticker.MultipleLocator(LOSS_RESOLUTION))
        axes.grid(which="minor", alpha=0.25)
        axes.set_ylabel("val loss difference, > 0: higher")


def final_text(run):
    step, loss, ms = run.val[-1]
    unfinished = "" if step == run.num_iterations else f" at step {step} of {run.num_iterations}"
    return f"val loss {loss:.4f} in {ms / 1000:.1f} s{unfinished}"


def step_times(run):
    """(step, ms of that step) from consecutive train lines: the speedrun's number, step by step."""
    return [(step, (ms - last_ms) / (step - last_step))
            for (last_step, last_ms), (step, ms) in zip(run.train, run.train[1:]) if step > last_step]


def comparison_figure(runs, record, labels=None, target=None):
    """Val loss against step and against train time (log scale); each run's val loss and train time
    minus the record's at the validation steps they share (the record is the zero line); the time of
    each step; the last third of training up close, with the target line. Why the runs may not be
    comparable (comparison_notes) is in the title."""
    aligned = [aligned_validation(run, record) for run in runs]  # first: refuses runs with nothing to compare
    figure = new_figure(figsize=(13, 14))
    (by_step, by_time), (loss_difference, time_difference), (step_time, zoom) = figure.subplots(3, 2)
    # The record's dashed black line is drawn last, over ours, so it shows where they coincide.
    names = labels or [os.path.basename(run.path) for run in runs]
    styles = [(run, {"color": f"C{i}", "label": name}) for i, (run, name) in enumerate(zip(runs, names))]
    styles.append((record, {"color": "black", "linestyle": "--", "label": f"record: {os.path.basename(record.path)}"}))
    last_third = 2 * max(run.num_iterations for run, _ in styles) // 3
    for run, style in styles:
        steps, losses, ms = zip(*run.val)
        by_step.plot(steps, losses, marker="o", markersize=3, **style)
        by_time.plot([m / 1000 for m in ms], losses, marker="o", markersize=3, **style)
        late = [(step, loss) for step, loss in zip(steps, losses) if step >= last_third]
        if late:
            zoom.plot(*zip(*late), marker="o", markersize=4, **style)
        if timed := step_times(run):
            step_time.plot(*zip(*timed), linewidth=0.8, **style)
    differences = []  # of every run, to scale the axis
    for rows, (_, style) in zip(aligned, styles):
        steps, losses, their_losses, ms, their_ms = zip(*rows)
        run_differences = [loss - theirs for loss, theirs in zip(losses, their_losses)]
        differences += run_differences
        loss_difference.plot(steps, run_differences, marker="o", markersize=4, **style)
        time_difference.plot(steps, [(m - theirs) / 1000 for m, theirs in zip(ms, their_ms)], marker="o",
                             markersize=4, **style)
    for axes in (loss_difference, time_difference):
        axes.axhline(0, color="black", linestyle="--", linewidth=1)
    loss_difference_axis(loss_difference, differences)
    if target is not None:
        zoom.axhline(target, color="red", linestyle=":", label=f"target {target}")
    for axes, title in ((by_step, "val loss against step"), (by_time, "val loss against train time"),
                        (loss_difference, "val loss minus the record's at the same step"),
                        (time_difference, "train time minus the record's at the same step"),
                        (step_time, "time of each training step"),
                        (zoom, f"the last third of training (from step {last_third})")):
        axes.set_title(title)
        axes.grid(alpha=0.4)
    for axes in (by_step, by_time):
        log_loss_axis(axes)
    by_step.legend(loc="upper right")
    for axes in (by_step, loss_difference, time_difference, step_time, zoom):
        axes.set_xlabel("step")
    by_time.set_xlabel("train time (s)")
    time_difference.set_ylabel("train time difference (s), > 0: slower")
    # the axis up to twice the median step: the steps beside a validation, much shorter or longer
    # in the logs, leave it
    timed = sorted(ms for run, _ in styles for _, ms in step_times(run))
    if timed:
        step_time.set_ylim(0, 2 * timed[len(timed) // 2])
    step_time.set_ylabel("ms per step (axis up to twice the median step)")
    zoom.set_ylabel("val loss")
    zoom.ticklabel_format(axis="y", useOffset=False)
    zoom.legend(loc="upper right")
    title = [f"record (dashed) {os.path.basename(record.path)}: {final_text(record)}"]
    for run, name, rows in zip(runs, names, aligned):
        step, loss, their_loss, ms, their_ms = rows[-1]
        title.append(f"{name}: {final_text(run)}; against the record at step {step}: "
                     f"{loss - their_loss:+.4f}, {(ms - their_ms) / 1000:+.1f} s")
        title += [f"note: {n}" for n in comparison_notes(run, record)]
    figure.suptitle("\n".join(dict.fromkeys(title)))  # a note shared by every run once
    return figure


def set_label(paths):
    """A set of runs by the folder that holds all of its paths."""
    return os.path.basename(os.path.commonpath([os.path.abspath(p) for p in paths]))


def stats_figure(sets, target, notes=()):
    """Each set's final val losses (a dot a run), their mean and its one-sided upper confidence
    bound (below the target exactly when p < SIGNIFICANCE), against the target line; each set's
    one-sample test under it. sets holds (label, runs) pairs: one set, or two for --against."""
    figure = new_figure(figsize=(9, 7))
    axes = figure.subplots()
    summaries, set_texts = [], []
    for x, (label, runs) in enumerate(sets):
        loss = summarize([run.final()[0] for run in runs])
        summaries.append(loss)
        # The runs' dots spread sideways in run order, so that equal losses stay apart.
        offsets = [0.3 * (i / (loss.n - 1) - 0.5) if loss.n > 1 else 0.0 for i in range(loss.n)]
        axes.scatter([x + o for o in offsets], [run.final()[0] for run in runs], color=f"C{x}", alpha=0.7, s=40,
                     label="final val loss of a run" if x == 0 else None)
        bound = upper_confidence_bound(loss)
        axes.errorbar([x + 0.3], [loss.mean], yerr=None if math.isnan(bound) else [[0], [bound - loss.mean]],
                      fmt="D", color="black", capsize=10,
                      label=f"mean; bar up to its one-sided {1 - SIGNIFICANCE:.0%} upper confidence bound,\n"
                            f"below the target exactly when p < {SIGNIFICANCE}" if x == 0 else None)
        t, df, p = one_sample_less(loss, target)
        verdict = {"yes": "", "no": f" (not < {SIGNIFICANCE})", "n/a": " (too few runs)"}[significance(p)]
        set_texts.append(f"{label} (n = {loss.n})\nmean {number(loss.mean, 5)}, std {number(loss.std, 5)}\n"
                         f"mean < {target}: t = {number(t, 3)}, df = {number(df, 0)}\np = {p_text(p)}{verdict}")
    title = [f"Final val loss against the target {target}"]
    if len(summaries) == 2:
        t, df, p = welch(*summaries)
        title.append(f"B against A, Welch's two-sided test: mean B - mean A = "
                     f"{number(summaries[1].mean - summaries[0].mean, 5)}, t = {number(t, 3)}, df = {number(df, 2)}, "
                     f"p = {p_text(p)}")
    title += [f"note: {n}" for n in notes]
    axes.axhline(target, color="red", linestyle="--", label=f"target {target}")
    axes.set_xticks(range(len(sets)), set_texts)
    axes.set_xlim(-0.6, len(sets) - 0.3)
    axes.set_ylabel("final val loss")
    axes.ticklabel_format(axis="y", useOffset=False)
    axes.grid(axis="y", alpha=0.4)
    axes.legend(loc="best")
    figure.suptitle("\n".join(title))
    return figure


# ------------------------------------------------------------------------------------------------
# Freezing: the trainer with every kernels/ and data/ header inlined, once, in inclusion order, from
# the working tree or from the source a run's log carries; its text embedded at its end, so that a
# run of it logs exactly the file, wherever it runs from.
# ------------------------------------------------------------------------------------------------
LOCAL_INCLUDE = re.compile(r'\s*#\s*include\s+"((?:kernels|data)/[^"]+)".*')
PRAGMA_ONCE = re.compile(r"\s*#\s*pragma\s+once\s*")
FROZEN_DEFINE = re.compile(r'#define SPEEDRUN_FROZEN_RECORD "([^"]*)"')
EMBED_MARKER = "// ===== this file's text above this line, embedded for the run log by tools/records.py ====="
EMBED_DELIMITER = "speedrun_source"
SOURCE_SECTION = re.compile(r"// ===== ([\w./-]+) =====")  # a CMake build's embedded file (embed_source.cmake)


def tree_files(root):
    """read(path) of the working tree."""
    def read(path):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    return read


def inlined(path, read, seen):
    seen.add(path)
    out = []
    for line in read(path).splitlines():
        if PRAGMA_ONCE.fullmatch(line):
            continue
        m = LOCAL_INCLUDE.fullmatch(line)
        if not m:
            out.append(line)
        elif m[1] not in seen:
            out += [f"// ===== {m[1]} (inlined) ====="] + inlined(m[1], read, seen) + [f"// ===== end of {m[1]} ====="]
    return out


def frozen_body(read):
    """train_gpt.cu with its headers inlined: what a frozen file holds between its head and its embedding."""
    return "\n".join(inlined("train_gpt.cu", read, set())) + "\n"


def single_file_trainer(record, read=None):
    """The frozen file of record (a folder name, or a note for `inline`): the build command, the
    record's name for the log, the body, and the text above the marker embedded as kTrainerSource."""
    head = [f"// Frozen single-file trainer of {record}: train_gpt.cu with its kernels/ and data/ headers",
            "// inlined by tools/records.py. Build it alone with:",
            f"//   {BUILD_COMMAND}",
            f'#define SPEEDRUN_FROZEN_RECORD "{record}"']
    text = "\n".join(head) + "\n" + frozen_body(read or tree_files(REPO))
    if f'){EMBED_DELIMITER}"' in text:
        raise RecordError(f"the trainer's text holds ){EMBED_DELIMITER}\", which ends the raw string embedding it")
    return f'{text}{EMBED_MARKER}\nconst char kTrainerSource[] = R"{EMBED_DELIMITER}({text}){EMBED_DELIMITER}";\n'


def body_of_frozen(text):
    """The body of a frozen file's text (or of the text a run of it logged), or None if it is not one."""
    lines = text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if FROZEN_DEFINE.fullmatch(line.rstrip("\n"))]
    if not heads:
        return None
    end = next((i for i, line in enumerate(lines) if line.rstrip("\n") == EMBED_MARKER), len(lines))
    return "".join(lines[heads[0] + 1:end])


def source_files(source):
    """{path: text} of a CMake build's embedded source (each file under its '// ===== path =====' line),
    or None if the text is not one."""
    files, path = {}, None
    for line in source.splitlines(keepends=True):
        m = SOURCE_SECTION.fullmatch(line.rstrip("\n"))
        if m:
            path = m[1]
            files[path] = ""
        elif path is None:
            return None
        else:
            files[path] += line
    return files if "train_gpt.cu" in files else None


def code_of(run):
    """The frozen body of the code a run was built from, from the source its log carries: a frozen
    file's, or a CMake build's inlined as freezing would. None if the log carries neither."""
    body = body_of_frozen(run.source)
    if body is not None:
        return body
    files = source_files(run.source)
    if files is None:
        return None

    def read(path):
        if path not in files:
            raise RecordError(f"{run.path}: its source includes {path}, which the log does not carry")
        return files[path]
    return frozen_body(read)


def log_code(paths):
    """The one code that produced every log named: refused if a log carries no source or two differ."""
    codes = {}
    for path in paths:
        run = parse_log(path)
        code = code_of(run)
        if code is None:
            raise RecordError(f"{path}: carries no source of this trainer (a CMake build's or a frozen file's)")
        codes.setdefault(code, []).append(path)
    if len(codes) > 1:
        groups = [", ".join(files) for files in codes.values()]
        raise RecordError(f"the logs were built from {len(codes)} different sources: {' | '.join(groups)}; "
                          "a record freezes one")
    return next(iter(codes))


def record_readme(folder, target):
    return f"""# {folder}

What changed: (describe the change against the previous record and why it is faster or better).

Target val loss: {target}

Data and hardware: (FineWeb or the offline corpus; GPUs; the trainer's flags).

## Build and run

```
{BUILD_COMMAND}    # in this folder
# from the repository's root (records/README.md, step 4): the logs come here
SPEEDRUN_TRAINER=records/{folder}/train_gpt ./run.sh --log-dir records/{folder} --self-check strict
```

## Results

Generated from this folder's logs by `python3 tools/records.py table`:

{TABLE_BEGIN}
{NO_RUNS}{TABLE_END}
"""


def freeze(name, date, target, records_dir, root=REPO, from_logs=None):
    """records/<date>_<name>/ with the frozen trainer: the working tree's, or the code that produced
    from_logs (which must agree)."""
    try:
        if datetime.date.fromisoformat(date).isoformat() != date:
            raise ValueError
    except ValueError:
        raise RecordError(f"--date {date}: not a date (YYYY-MM-DD)") from None
    if not (math.isfinite(target) and target > 0):
        raise RecordError(f"--target {target}: a val loss is a finite number above 0")
    folder = f"{date}_{name}"
    if not RECORD_FOLDER.fullmatch(folder):
        raise RecordError(f"{folder}: not a record folder name (YYYY-MM-DD_name, letters, digits, _ . -)")
    path = os.path.join(records_dir, folder)
    if os.path.exists(path):
        raise RecordError(f"{path}: already exists; a record is frozen once")
    if from_logs:
        body = log_code(from_logs)
        text = single_file_trainer(folder, read=lambda p: body if p == "train_gpt.cu" else "")
    else:
        text = single_file_trainer(folder, read=tree_files(root))
    os.makedirs(path)
    write_text(os.path.join(path, "train_gpt.cu"), text)
    write_text(os.path.join(path, "README.md"), record_readme(folder, target))
    return path


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------------
# Generated tables: each record's results in its README, and the list of records in README.md.
# ------------------------------------------------------------------------------------------------
def record_folders(records_dir):
    if not os.path.isdir(records_dir):
        return []
    return sorted(n for n in os.listdir(records_dir)
                  if RECORD_FOLDER.fullmatch(n) and os.path.isdir(os.path.join(records_dir, n)))


def record_target(folder, required=True):
    """The target val loss folder/README.md names (None where it names none and none is required)."""
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        m = TARGET_LINE.search(f.read())
    if not m and not required:
        return None
    if not m:
        raise RecordError(f"{folder}/README.md: no 'Target val loss: X' line")
    if float(m[1]) <= 0:
        raise RecordError(f"{folder}/README.md: target val loss {m[1]}: a val loss is a finite number above 0")
    return float(m[1])


def has_logs(folder):
    return any(n.endswith(".txt") for n in os.listdir(folder))


def record_runs(folder):
    """The finished runs of a record's folder, refused unless each log carries the record's own code."""
    with open(os.path.join(folder, "train_gpt.cu"), encoding="utf-8") as f:
        body = body_of_frozen(f.read())
    if body is None:
        raise RecordError(f"{folder}/train_gpt.cu: not a frozen trainer (no SPEEDRUN_FROZEN_RECORD line)")
    for path in log_files([folder]):
        if code_of(parse_log(path)) != body:
            raise RecordError(f"{path}: was not built from {folder}/train_gpt.cu (the source it carries differs): "
                              "a record's logs are runs of its frozen file")
    return finished_runs([folder])


def record_results(folder):
    if not has_logs(folder):
        return NO_RUNS
    runs = record_runs(folder)
    return stats_report(runs, record_target(folder), notes=comparability_notes(runs))


def records_table(records_dir):
    rows = []
    for name in record_folders(records_dir):
        folder = os.path.join(records_dir, name)
        target = record_target(folder)
        no_runs = ["0"] + ["n/a"] * (len(set_header(target)) - 1)
        stats = set_row(record_runs(folder), target) if has_logs(folder) else no_runs
        rows.append([f"[{name}](records/{name}/)", str(target)] + stats)
    if not rows:
        return "No records yet: the first comes with the trainer's first runs (see `records/README.md`).\n"
    return markdown(["record", "target"] + set_header("target"), rows)


def with_block(text, block, where):
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise RecordError(f"{where}: no {TABLE_BEGIN} ... {TABLE_END} block")
    return text[:begin + len(TABLE_BEGIN)] + "\n" + block + text[end:]


def update_tables(root=REPO, check=False):
    """Regenerates every generated block; returns the files that were (with check: would be) changed."""
    records_dir = os.path.join(root, "records")
    targets = [(os.path.join(root, "README.md"), records_table(records_dir))]
    targets += [(os.path.join(records_dir, n, "README.md"), record_results(os.path.join(records_dir, n)))
                for n in record_folders(records_dir)]
    changed = []
    for path, block in targets:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = with_block(text, block, path)
        if new != text:
            changed.append(path)
            if not check:
                write_text(path, new)
    return changed


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("freeze", help="freeze the current trainer into records/<date>_<name>/")
    p.add_argument("name")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--target", type=float, default=FINEWEB_TARGET, help="val loss the runs must beat")
    p.add_argument("--from-log", nargs="+", metavar="LOG",
                   help="freeze the code these runs' logs carry (all the same) instead of the working tree's")
    p.add_argument("--records-dir", default=os.path.join(REPO, "records"))
    p = sub.add_parser("inline", help="write the single-file trainer to OUTPUT")
    p.add_argument("output")
    p = sub.add_parser("stats", help="statistics of the final val loss and train time of a set of runs")
    p.add_argument("logs", nargs="+", metavar="LOG|DIR")
    p.add_argument("--against", nargs="+", metavar="LOG|DIR",
                   help="a second set: Welch's t-tests of it against the first")
    p.add_argument("--target", type=float,
                   help=f"val loss of the one-sided test (default: the target a record folder's README names, "
                        f"else FineWeb's {FINEWEB_TARGET}, for runs on FineWeb)")
    p.add_argument("--png", metavar="FILE", help="plot the final val losses against the target (matplotlib)")
    p = sub.add_parser("compare", help="step-aligned validation of our runs against a record's run, and a plot")
    p.add_argument("ours", nargs="+", metavar="OURS", help="our run logs")
    p.add_argument("record", metavar="RECORD", help="the record's run log")
    p.add_argument("--png", metavar="FILE", help="plot the val losses and their differences (matplotlib)")
    p.add_argument("--label", nargs="+", metavar="LABEL", help="a name for each of our runs, in their order")
    p.add_argument("--target", type=float, help="val loss drawn on the close-up of the last third")
    p = sub.add_parser("table", help="regenerate the record tables of README.md and records/*/README.md")
    p.add_argument("--check", action="store_true", help="change nothing; fail if a table is out of date")
    args = parser.parse_args(argv)
    if getattr(args, "png", None) and not args.png.lower().endswith(".png"):
        parser.error(f"--png {args.png}: writes a PNG image; name a file ending in .png")
    try:
        return run_command(args)
    except (RecordError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_command(args):
    if getattr(args, "target", None) is not None and not (math.isfinite(args.target) and args.target > 0):
        raise RecordError(f"--target {args.target}: a val loss is a finite number above 0")
    if args.command == "freeze":
        path = freeze(args.name, args.date, args.target, args.records_dir, from_logs=args.from_log)
        print(f"{path}: frozen. Next: fill in its README, build and run it, copy every run's log there, "
              "then `python3 tools/records.py table`.")
    elif args.command == "inline":
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        write_text(args.output, single_file_trainer("the working tree (records.py inline, not a record)"))
    elif args.command == "stats":
        runs = finished_runs(args.logs)
        against = finished_runs(args.against) if args.against else None
        refuse_duplicates(runs + (against or []))
        target, notes = stats_target(args.target, args.logs + (args.against or []), runs + (against or []))
        notes += comparability_notes(runs) + (comparability_notes(against) if against else [])
        notes += set_differences(runs, against) if against else []
        sets = [(f"A: {set_label(args.logs)}", runs), (f"B: {set_label(args.against)}", against)] if against \
            else [(set_label(args.logs), runs)]
        figure = stats_figure(sets, target, notes) if args.png else None  # before any output: may lack matplotlib
        print(stats_report(runs, target, against, notes), end="")
        if figure:
            figure.savefig(args.png)
            print(f"\n{args.png}: the final val loss of each run, the mean and its upper confidence bound, "
                  "against the target")
    elif args.command == "compare":
        runs, record = [parse_log(path) for path in args.ours], parse_log(args.record)
        if args.label and len(args.label) != len(runs):
            raise RecordError(f"--label names {len(args.label)} runs, but {len(runs)} are compared: one label each")
        labels = args.label or [None] * len(runs)
        figure = comparison_figure(runs, record, args.label, args.target) if args.png else None  # may lack matplotlib
        print("\n".join(comparison_table(run, record, label) for run, label in zip(runs, labels)), end="")
        if figure:
            figure.savefig(args.png)
            print(f"\n{args.png}: val loss against step and train time, and ours minus the record's")
    elif args.command == "table":
        changed = update_tables(check=args.check)
        for path in changed:
            print(f"{path}: {'out of date' if args.check else 'updated'}")
        if not changed:
            print("every record table is up to date")
        return 1 if args.check and changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
