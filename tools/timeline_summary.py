#!/usr/bin/env python3
"""Where a training step's time goes, from the Chrome trace that `train_gpt --timeline-step N`
writes (logs/timeline_rank<r>_step<N>.json): per part of the step (forward, head, backward,
optimizer updates, collectives) the number of spans, their summed time and their share of the
step, then how long each lane was busy and how long the compute lane sat idle inside the step
(waiting for a reduction or a gather, the exposed communication, or for the host to queue work).
One markdown table per trace.

Usage: tools/timeline_summary.py TRACE.json [TRACE.json ...]
"""
import json
import sys

# (part, test on a span's lane and name), first match wins; the order is the step's.
PARTS = [
    ("forward", lambda lane, name: lane == "compute" and name == "forward"),
    ("head (and its backward)", lambda lane, name: lane == "compute" and name.startswith("head")),
    ("backward of the blocks", lambda lane, name: lane == "compute" and name.startswith("backward block ")),
    ("backward of the embeddings", lambda lane, name: lane == "compute" and name == "backward embedding"),
    ("Muon updates", lambda lane, name: lane == "compute" and name.startswith("update Muon group")),
    ("Adam updates", lambda lane, name: lane == "compute" and name.startswith("update ")),
    ("reductions", lambda lane, name: lane == "communication" and name.startswith("reduce ")),
    ("all-gathers", lambda lane, name: lane == "communication" and name.startswith("gather ")),
]


def read_spans(path):
    """[(lane, name, start_us, end_us)] of a trace, lanes named by its metadata events."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [(lanes.get(e["tid"], str(e["tid"])), e["name"], e["ts"], e["ts"] + e["dur"])
             for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError(f"{path}: no spans")
    return spans


def busy_time(intervals):
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def summary(spans):
    """Rows (part, spans, ms, share of the step) and the step's length in ms."""
    step_us = max(s[3] for s in spans) - min(s[2] for s in spans)
    rows = []
    unmatched = list(spans)
    for part, matches in PARTS:
        mine = [s for s in unmatched if matches(s[0], s[1])]
        unmatched = [s for s in unmatched if not matches(s[0], s[1])]
        if mine:
            us = sum(s[3] - s[2] for s in mine)
            rows.append((part, len(mine), us / 1000, us / step_us))
    if unmatched:
        us = sum(s[3] - s[2] for s in unmatched)
        rows.append(("other", len(unmatched), us / 1000, us / step_us))
    for lane in sorted({s[0] for s in spans}):
        us = busy_time([(s[2], s[3]) for s in spans if s[0] == lane])
        rows.append((f"{lane} lane busy", "", us / 1000, us / step_us))
    compute = [(s[2], s[3]) for s in spans if s[0] == "compute"]
    if compute:
        idle_us = (max(e for _, e in compute) - min(b for b, _ in compute)) - busy_time(compute)
        rows.append(("compute lane idle inside the step", "", idle_us / 1000, idle_us / step_us))
    return rows, step_us / 1000


def markdown(path, rows, step_ms):
    lines = [f"{path}: step {step_ms:.2f} ms", "", "| part | spans | ms | share |", "|---|---|---|---|"]
    lines += [f"| {part} | {count} | {ms:.2f} | {share:.1%} |" for part, count, ms, share in rows]
    return "\n".join(lines)


def main(paths):
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        try:
            rows, step_ms = summary(read_spans(path))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 1
        print(markdown(path, rows, step_ms) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
