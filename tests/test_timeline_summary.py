#!/usr/bin/env python3
"""tools/timeline_summary.py on a trace in the layout Timeline::write_chrome_trace writes."""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import timeline_summary  # noqa: E402


def trace(spans):
    """spans: [(lane, name, ts_us, dur_us)] as kernels/host/timeline.cuh writes them."""
    lanes, events = [], []
    for lane, name, ts, dur in spans:
        if lane not in lanes:
            lanes.append(lane)
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": lanes.index(lane), "args": {"name": lane}})
        events.append({"name": name, "ph": "X", "pid": 0, "tid": lanes.index(lane), "ts": ts, "dur": dur})
    return {"traceEvents": events}


# A step of 100 us: compute busy 0-60 and 70-100 (idle 60-70 waiting for a gather), the
# communication lane's reduce overlapping the backward and its gathers partly exposed.
STEP = [
    ("compute", "forward", 0.0, 20.0),
    ("compute", "head and its backward", 20.0, 10.0),
    ("compute", "backward block 1", 30.0, 10.0),
    ("compute", "backward block 0", 40.0, 10.0),
    ("communication", "reduce lm_head.weight", 35.0, 20.0),
    ("compute", "backward embedding", 50.0, 5.0),
    ("compute", "update lm_head.weight", 55.0, 5.0),
    ("communication", "gather lm_head.weight", 60.0, 10.0),
    ("compute", "update Muon group of blocks.0.mlp.c_fc.weight", 70.0, 25.0),
    ("compute", "refresh", 95.0, 5.0),
]


class TimelineSummaryTest(unittest.TestCase):
    def rows(self, spans):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "timeline_rank0_step5.json")
            with open(path, "w") as f:
                json.dump(trace(spans), f)
            rows, step_ms = timeline_summary.summary(timeline_summary.read_spans(path))
        return {part: (count, ms, share) for part, count, ms, share in rows}, step_ms

    def test_parts_busy_and_idle(self):
        rows, step_ms = self.rows(STEP)
        self.assertAlmostEqual(step_ms, 0.1)
        expected = {
            "forward": (1, 0.020),
            "head (and its backward)": (1, 0.010),
            "backward of the blocks": (2, 0.020),
            "backward of the embeddings": (1, 0.005),
            "Muon updates": (1, 0.025),
            "Adam updates": (1, 0.005),
            "reductions": (1, 0.020),
            "all-gathers": (1, 0.010),
            "other": (1, 0.005),
        }
        for part, (count, ms) in expected.items():
            self.assertEqual(rows[part][0], count, part)
            self.assertAlmostEqual(rows[part][1], ms, msg=part)
        self.assertAlmostEqual(rows["compute lane busy"][1], 0.090)
        self.assertAlmostEqual(rows["communication lane busy"][1], 0.030)
        self.assertAlmostEqual(rows["compute lane idle inside the step"][1], 0.010)
        self.assertAlmostEqual(rows["compute lane idle inside the step"][2], 0.1)

    def test_busy_time_merges_overlaps(self):
        self.assertEqual(timeline_summary.busy_time([(0, 10), (5, 15), (20, 30), (21, 22)]), 25)

    def test_refuses_a_trace_without_spans(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "empty.json")
            with open(path, "w") as f:
                json.dump({"traceEvents": []}, f)
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(timeline_summary.main([path]), 1)
            self.assertIn("no spans", err.getvalue())

    def test_prints_a_markdown_table(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.json")
            with open(path, "w") as f:
                json.dump(trace(STEP), f)
            with contextlib.redirect_stdout(io.StringIO()) as out:
                self.assertEqual(timeline_summary.main([path]), 0)
        self.assertIn("| backward of the blocks | 2 | 0.02 | 20.0% |", out.getvalue())
        self.assertIn("step 0.10 ms", out.getvalue())


if __name__ == "__main__":
    unittest.main()
