#!/usr/bin/env python3
"""Records of the speedrun: frozen single-file trainers, the statistics of their run logs, the
comparison of two runs, and the generated record tables. Standard library only.

  records.py freeze NAME [--date YYYY-MM-DD] [--target 3.28]  new records/<date>_<NAME>/
  records.py inline OUTPUT                                    the single-file trainer only
  records.py stats LOG|DIR... [--against LOG|DIR...] [--target 3.28]
  records.py compare OURS RECORD [--png FILE]
  records.py table [--check]                                  regenerate the README tables
"""
import argparse
import datetime
import math
import os
import re
import statistics
import struct
import sys
import zlib
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINEWEB_TARGET = 3.28  # the community rule: mean final val loss < 3.28 at p < 0.01
SIGNIFICANCE = 0.01
BUILD_COMMAND = ("nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr "
                 "-o train_gpt train_gpt.cu -lcublasLt -lcublas -lnccl")
TABLE_BEGIN, TABLE_END = "<!-- records:begin -->", "<!-- records:end -->"
RECORD_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}_[A-Za-z0-9][A-Za-z0-9_.-]*")
TARGET_LINE = re.compile(r"^Target val loss: ([0-9.]+)$", re.M)
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


@dataclass
class Run:
    path: str
    num_iterations: int = 0
    val: list = field(default_factory=list)    # (step, val loss, train ms) at validation steps
    train: list = field(default_factory=list)  # (step, train ms) after training steps

    def final(self):
        """(val loss, train ms) of the final step:N/N val_loss line, or None if the run did not finish."""
        last = [(loss, ms) for step, loss, ms in self.val if step == self.num_iterations]
        return last[-1] if last else None


def parse_log(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rules = [i for i, line in enumerate(lines) if line == LOG_RULE]
    run = Run(path)
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
            raise RecordError(f"{run.path}: did not finish: no final step:{run.num_iterations}/"
                              f"{run.num_iterations} val_loss line (last step seen: {last})")
        if not math.isfinite(final[0]):
            raise RecordError(f"{run.path}: final val_loss is {final[0]}")
    by_target = {}
    for run in runs:
        by_target.setdefault(run.num_iterations, []).append(run.path)
    if len(by_target) > 1:
        mix = "; ".join(f"{n} steps in {', '.join(files)}" for n, files in sorted(by_target.items()))
        raise RecordError(f"runs mix targets: {mix}")
    return runs


# ------------------------------------------------------------------------------------------------
# Statistics: Student's t distribution through the regularised incomplete beta function.
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


def one_sample_less_p(s, target):
    """One-sided one-sample t-test of mean < target (scipy.stats.ttest_1samp(..., alternative='less'))."""
    if s.n < 2:
        return math.nan
    if s.std == 0:
        return 0.0 if s.mean < target else 1.0
    return t_cdf((s.mean - target) / (s.std / math.sqrt(s.n)), s.n - 1)


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


def loss_and_seconds(runs):
    """Summaries of the final val loss and of the train time in seconds."""
    return summarize([r.final()[0] for r in runs]), summarize([r.final()[1] / 1000 for r in runs])


def set_row(runs, target):
    loss, seconds = loss_and_seconds(runs)
    p = one_sample_less_p(loss, target)
    significant = "n/a" if math.isnan(p) else "yes" if p < SIGNIFICANCE else "no"
    return [str(loss.n), str(runs[0].num_iterations), number(loss.mean, 5), number(loss.std, 5),
            number(p, 4), significant, number(seconds.mean, 3), number(seconds.std, 3)]


def set_header(target):
    return ["runs", "steps", "val loss mean", "val loss std", f"p (mean < {target})", f"p < {SIGNIFICANCE}",
            "time mean (s)", "time std (s)"]


def runs_table(runs):
    return markdown(["log", "final val loss", "train time (s)"],
                    [[os.path.basename(r.path), f"{r.final()[0]:.4f}", f"{r.final()[1] / 1000:.3f}"] for r in runs])


def stats_report(runs, target, against=None):
    if against is None:
        return runs_table(runs) + "\n" + markdown(set_header(target), [set_row(runs, target)])
    report = markdown(["set"] + set_header(target), [["A"] + set_row(runs, target), ["B"] + set_row(against, target)])
    rows = []
    quantities = zip(("val loss", "train time (s)"), loss_and_seconds(runs), loss_and_seconds(against), (5, 3))
    for name, a, b, digits in quantities:
        t, df, p = welch(a, b)
        rows.append([name, number(b.mean - a.mean, digits), number(t, 3), number(df, 2), number(p, 4)])
    return report + "\nWelch's t-test, B against A (two-sided):\n\n" + markdown(
        ["quantity", "mean B - mean A", "t", "df", "p"], rows)


# ------------------------------------------------------------------------------------------------
# Comparison of two runs: step-aligned validation table and a PNG of both curves.
# ------------------------------------------------------------------------------------------------
def comparison_table(ours, record):
    theirs = {step: (loss, ms) for step, loss, ms in record.val}
    rows = [[str(step), f"{loss:.4f}", f"{theirs[step][0]:.4f}", f"{loss - theirs[step][0]:+.4f}",
             str(ms), str(theirs[step][1]), f"{ms - theirs[step][1]:+d}"]
            for step, loss, ms in ours.val if step in theirs]
    if not rows:
        raise RecordError(f"{ours.path} and {record.path}: no validation step in common")
    note = "" if ours.num_iterations == record.num_iterations else (
        f"note: ours runs {ours.num_iterations} steps, the record {record.num_iterations}; "
        "steps compared by number\n\n")
    return note + markdown(["step", "ours val loss", "record val loss", "delta loss",
                            "ours time (ms)", "record time (ms)", "delta time (ms)"], rows)


OURS_COLOUR, RECORD_COLOUR = (31, 119, 180), (255, 127, 14)
GRID, AXIS, WHITE = (220, 220, 220), (0, 0, 0), (255, 255, 255)


class Canvas:
    def __init__(self, width, height):
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x, y, colour, radius=0):
        for yy in range(y - radius, y + radius + 1):
            for xx in range(x - radius, x + radius + 1):
                if 0 <= xx < self.width and 0 <= yy < self.height:
                    i = 3 * (yy * self.width + xx)
                    self.pixels[i:i + 3] = bytes(colour)

    def line(self, x0, y0, x1, y1, colour, radius=0):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), colour, radius)

    def png(self):
        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def draw_panel(canvas, left, top, size, curves):
    """Val loss (log scale, grid at whole losses) against x, x from 0 to the largest x of the curves."""
    x_max = max(x for points, _, _ in curves for x, _ in points) or 1
    losses = [loss for points, _, _ in curves for _, loss in points]
    low, high = math.log(min(losses)) - 0.02, math.log(max(losses)) + 0.02
    def px(x, loss):
        return (left + round(x / x_max * size),
                top + size - round((math.log(loss) - low) / (high - low) * size))
    for whole in range(math.ceil(math.exp(low)), math.floor(math.exp(high)) + 1):
        y = px(0, whole)[1]
        canvas.line(left, y, left + size, y, GRID)
    for tenth in range(11):
        x = left + size * tenth // 10
        canvas.line(x, top + size, x, top + size + 6, AXIS)
    canvas.line(left, top, left, top + size, AXIS)
    canvas.line(left, top + size, left + size, top + size, AXIS)
    for points, colour, radius in curves:
        for (x0, l0), (x1, l1) in zip(points, points[1:]):
            canvas.line(*px(x0, l0), *px(x1, l1), colour, radius)


def comparison_png(ours, record, path, size=400, margin=40):
    canvas = Canvas(2 * size + 3 * margin, size + 2 * margin)
    for panel, x_of in enumerate((lambda step, ms: step, lambda step, ms: ms)):
        # The record's line is wider, so it shows around ours where the two coincide.
        curves = [([(x_of(s, ms), loss) for s, loss, ms in run.val], colour, radius)
                  for run, colour, radius in ((record, RECORD_COLOUR, 2), (ours, OURS_COLOUR, 1))]
        draw_panel(canvas, margin + panel * (size + margin), margin, size, curves)
    with open(path, "wb") as f:
        f.write(canvas.png())


# ------------------------------------------------------------------------------------------------
# Freezing: the trainer with every kernels/ and data/ header inlined, once, in inclusion order.
# ------------------------------------------------------------------------------------------------
LOCAL_INCLUDE = re.compile(r'\s*#\s*include\s+"((?:kernels|data)/[^"]+)".*')
PRAGMA_ONCE = re.compile(r"\s*#\s*pragma\s+once\s*")


def inlined(path, root, seen):
    seen.add(path)
    with open(os.path.join(root, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        if PRAGMA_ONCE.fullmatch(line):
            continue
        m = LOCAL_INCLUDE.fullmatch(line)
        if not m:
            out.append(line)
        elif m[1] not in seen:
            out += [f"// ===== {m[1]} (inlined) ====="] + inlined(m[1], root, seen) + [f"// ===== end of {m[1]} ====="]
    return out


def single_file_trainer(root=REPO):
    head = ["// Frozen single-file trainer: train_gpt.cu with its kernels/ and data/ headers inlined by",
            "// tools/records.py. Build it alone with:",
            f"//   {BUILD_COMMAND}"]
    return "\n".join(head + inlined("train_gpt.cu", root, set())) + "\n"


def record_readme(folder, target):
    return f"""# {folder}

What changed: (describe the change against the previous record and why it is faster or better).

Target val loss: {target}

Data and hardware: (FineWeb or the offline corpus; GPUs; the trainer's flags).

## Build and run

```
{BUILD_COMMAND}
./train_gpt --num-iterations ...    # each run writes logs/<run-id>.txt: copy it here
```

## Results

Generated from this folder's logs by `python3 tools/records.py table`:

{TABLE_BEGIN}
{NO_RUNS}{TABLE_END}
"""


def freeze(name, date, target, records_dir, root=REPO):
    folder = f"{date}_{name}"
    if not RECORD_FOLDER.fullmatch(folder):
        raise RecordError(f"{folder}: not a record folder name (YYYY-MM-DD_name, letters, digits, _ . -)")
    path = os.path.join(records_dir, folder)
    if os.path.exists(path):
        raise RecordError(f"{path}: already exists; a record is frozen once")
    os.makedirs(path)
    write_text(os.path.join(path, "train_gpt.cu"), single_file_trainer(root))
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


def record_target(folder):
    with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
        m = TARGET_LINE.search(f.read())
    if not m:
        raise RecordError(f"{folder}/README.md: no 'Target val loss: X' line")
    return float(m[1])


def has_logs(folder):
    return any(n.endswith(".txt") for n in os.listdir(folder))


def record_results(folder):
    if not has_logs(folder):
        return NO_RUNS
    return stats_report(finished_runs([folder]), record_target(folder))


def records_table(records_dir):
    rows = []
    for name in record_folders(records_dir):
        folder = os.path.join(records_dir, name)
        target = record_target(folder)
        stats = set_row(finished_runs([folder]), target) if has_logs(folder) else ["0"] + ["n/a"] * 7
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
    p.add_argument("--records-dir", default=os.path.join(REPO, "records"))
    p = sub.add_parser("inline", help="write the single-file trainer to OUTPUT")
    p.add_argument("output")
    p = sub.add_parser("stats", help="statistics of the final val loss and train time of a set of runs")
    p.add_argument("logs", nargs="+", metavar="LOG|DIR")
    p.add_argument("--against", nargs="+", metavar="LOG|DIR",
                   help="a second set: Welch's t-tests of it against the first")
    p.add_argument("--target", type=float, default=FINEWEB_TARGET, help="val loss of the one-sided test")
    p = sub.add_parser("compare", help="step-aligned validation of our run against a record's, and a PNG")
    p.add_argument("ours")
    p.add_argument("record")
    p.add_argument("--png", default="comparison.png")
    p = sub.add_parser("table", help="regenerate the record tables of README.md and records/*/README.md")
    p.add_argument("--check", action="store_true", help="change nothing; fail if a table is out of date")
    args = parser.parse_args(argv)
    try:
        return run_command(args)
    except (RecordError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_command(args):
    if args.command == "freeze":
        path = freeze(args.name, args.date, args.target, args.records_dir)
        print(f"{path}: frozen. Next: fill in its README, build and run it, copy every run's log there, "
              "then `python3 tools/records.py table`.")
    elif args.command == "inline":
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        write_text(args.output, single_file_trainer())
    elif args.command == "stats":
        against = finished_runs(args.against) if args.against else None
        print(stats_report(finished_runs(args.logs), args.target, against), end="")
    elif args.command == "compare":
        ours, record = parse_log(args.ours), parse_log(args.record)
        print(comparison_table(ours, record), end="")
        comparison_png(ours, record, args.png)
        print(f"\n{args.png}: val loss (log scale) against step (left) and train time (right); "
              f"blue: ours ({ours.path}), orange: record ({record.path})")
    elif args.command == "table":
        changed = update_tables(check=args.check)
        for path in changed:
            print(f"{path}: {'out of date' if args.check else 'updated'}")
        return 1 if args.check and changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
