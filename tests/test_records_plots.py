#!/usr/bin/env python3
"""tools/records.py's plots (compare --png, stats --png): the files are PNGs of a sensible size,
and the figures carry what a reader needs without the console text (axis labels, legend, title,
log-scaled loss, a difference panel where 0.001 shows). Needs matplotlib: without it, exits 77,
which CTest reports as skipped."""
import os
import struct
import sys
import unittest

try:
    import matplotlib  # noqa: F401
except ImportError:
    print(f"skipped: {sys.executable} has no matplotlib; install python3-matplotlib (Debian, Ubuntu) "
          "or `pip install matplotlib`")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_records import REFERENCE, REFERENCE_LOGS, TempDir, records  # noqa: E402

FIRST, SECOND, RECORD = (os.path.join(REFERENCE, name) for name in REFERENCE_LOGS)


def png_size(test, path):
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    test.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
    test.assertEqual(head[12:16], b"IHDR")
    return struct.unpack(">II", head[16:24])


def suptitle(figure):
    return figure._suptitle.get_text()  # matplotlib 3.6 (Debian 12's) has no get_suptitle yet


def line_data(axes):
    """{label: (x, y)} of the axes' labelled lines."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()
            if not line.get_label().startswith("_")}


class ComparisonPlot(TempDir):
    def setUp(self):
        super().setUp()
        self.runs = [records.parse_log(FIRST), records.parse_log(SECOND)]
        self.record = records.parse_log(RECORD)
        self.figure = records.comparison_figure(self.runs, self.record)
        (self.by_step, self.by_time, self.loss_difference, self.time_difference, self.step_time,
         self.zoom) = self.figure.axes

    def test_compare_writes_a_png(self):
        png = os.path.join(self.dir, "cmp.png")
        rc, out, _ = self.command("compare", FIRST, SECOND, RECORD, "--png", png)
        self.assertEqual(rc, 0)
        self.assertIn(f"{png}: val loss against step and train time", out)
        width, height = png_size(self, png)
        self.assertGreaterEqual(width, 1000)
        self.assertGreaterEqual(height, 700)
        self.assertGreater(os.path.getsize(png), 30000)  # drawn text and curves, not a blank canvas

    def test_compare_refuses_a_run_without_common_validation_before_drawing(self):
        png = os.path.join(self.dir, "none.png")
        late = self.write("late.txt", "step:1/7 train_time:9ms step_avg:9.00ms\n")
        rc, out, err = self.command("compare", late, RECORD, "--png", png)
        self.assertEqual((rc, out), (1, ""))
        self.assertIn("no validation step in common", err)
        self.assertFalse(os.path.exists(png))

    def test_loss_panels_are_log_scaled_and_labelled(self):
        for axes, x_label in ((self.by_step, "step"), (self.by_time, "train time (s)")):
            self.assertEqual(axes.get_yscale(), "log")
            self.assertEqual(axes.get_xlabel(), x_label)
            self.assertEqual(axes.get_ylabel(), "val loss (log scale)")
            self.assertTrue(axes.get_title())
            labels = [label.get_text() for label in axes.get_yticklabels() if label.get_text()]
            self.assertIn("4", labels)  # plain numbers, not 4x10^0
        curves = line_data(self.by_time)
        self.assertEqual(curves[REFERENCE_LOGS[0]][0][-1], 177.93)
        self.assertEqual(curves[f"record: {REFERENCE_LOGS[2]}"][1][-1], 3.2794)

    def test_legend_names_each_run_file(self):
        legend = [text.get_text() for text in self.by_step.get_legend().get_texts()]
        self.assertEqual(legend, [REFERENCE_LOGS[0], REFERENCE_LOGS[1], f"record: {REFERENCE_LOGS[2]}"])

    def test_title_gives_final_losses_times_and_differences(self):
        title = suptitle(self.figure)
        self.assertIn(f"record (dashed) {REFERENCE_LOGS[2]}: val loss 3.2794 in 173.8 s", title)
        self.assertIn(f"{REFERENCE_LOGS[0]}: val loss 3.2782 in 177.9 s; against the record at step 1770: "
                      "-0.0012, +4.1 s", title)
        self.assertIn(f"{REFERENCE_LOGS[1]}: val loss 3.2785 in 178.1 s", title)

    def test_difference_panel_shows_a_thousandth(self):
        steps, differences = line_data(self.loss_difference)[REFERENCE_LOGS[0]]
        self.assertEqual(steps[-1], 1770)
        self.assertAlmostEqual(differences[-1], -0.0012, places=9)
        self.assertEqual(self.loss_difference.get_yscale(), "linear")
        low, high = self.loss_difference.get_ylim()
        self.assertLessEqual(high - low, 20 * records.LOSS_RESOLUTION)  # 0.001 is at least 1/20 of the panel
        self.assertLess(low, min(differences))
        self.assertGreater(high, max(differences))
        self.assertIn(0.001, [round(t, 6) for t in self.loss_difference.yaxis.get_minorticklocs()])
        self.assertIn([0.0, 0.0], [list(line.get_ydata()) for line in self.loss_difference.get_lines()])  # the record
        self.assertEqual(self.loss_difference.get_xlabel(), "step")
        self.assertEqual(self.loss_difference.get_ylabel(), "val loss difference, > 0: higher")
        times = line_data(self.time_difference)[REFERENCE_LOGS[1]][1]
        self.assertAlmostEqual(times[-1], 4.275, places=9)
        self.assertEqual(self.time_difference.get_ylabel(), "train time difference (s), > 0: slower")

    def test_time_of_each_step_and_the_last_third_with_the_target(self):
        steps, ms = line_data(self.step_time)[f"record: {REFERENCE_LOGS[2]}"]
        record = records.parse_log(RECORD)
        self.assertEqual(steps[0], record.train[1][0])
        self.assertEqual(ms[-1], record.train[-1][1] - record.train[-2][1])  # the last step's own time
        self.assertIn("ms per step", self.step_time.get_ylabel())
        figure = records.comparison_figure(self.runs, self.record, labels=["first", "second"], target=3.28)
        zoom = figure.axes[5]
        self.assertIn("from step 1180", zoom.get_title())  # 2/3 of 1770
        curves = line_data(zoom)
        self.assertEqual(min(curves["first"][0]), min(s for s, _, _ in self.runs[0].val if s >= 1180))
        self.assertIn("target 3.28", curves)
        self.assertEqual(curves["target 3.28"][1], [3.28, 3.28])
        legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        self.assertEqual(legend[:2], ["first", "second"])

    def test_runs_of_other_lengths_or_data_say_so_on_the_plot(self):
        short = self.write("short.txt", "".join(
            f"step:{s}/860 val_loss:{4.0 - s / 1000:.4f} train_time:{s * 90}ms step_avg:90.00ms\n" for s in (0, 125, 250, 860)))
        figure = records.comparison_figure([records.parse_log(short)], self.record)
        title = suptitle(figure)
        self.assertIn("note: ours runs 860 steps, the record 1770: the schedules differ, steps are compared by number only",
                      title)
        self.assertIn("note: settings not in both logs", title)
        rc, out, _ = self.command("compare", short, RECORD)
        self.assertEqual(rc, 0)
        self.assertIn("final: ours 3.1400 at step 860 in 77.4 s, the record 3.2794 at step 1770 in 173.8 s: -0.1394, -96.4 s",
                      out)

    def test_large_differences_go_symlog_keeping_a_thousandth_visible(self):
        with open(FIRST) as f:
            far = self.write("far.txt", f.read().replace("step:0/1770 val_loss:10.8258", "step:0/1770 val_loss:10.9258"))
        figure = records.comparison_figure([records.parse_log(far)], self.record)
        loss_difference = figure.axes[2]
        self.assertEqual(loss_difference.get_yscale(), "symlog")
        self.assertEqual(loss_difference.yaxis.get_transform().linthresh, records.LOSS_RESOLUTION)
        self.assertIn("linear within ±0.001", loss_difference.get_ylabel())


class StatsPlot(TempDir):
    def test_stats_writes_a_png(self):
        png = os.path.join(self.dir, "stats.png")
        rc, out, _ = self.command("stats", REFERENCE, "--png", png)
        self.assertEqual(rc, 0)
        self.assertIn("| 3 | 1770 | 3.27870 | 0.00062 | -3.606 | 2 | 0.0345 | no |", out)  # the table still
        width, height = png_size(self, png)
        self.assertGreaterEqual(width, 700)
        self.assertGreaterEqual(height, 500)

    def test_final_losses_mean_bound_and_target(self):
        runs = records.finished_runs([REFERENCE])
        figure = records.stats_figure([("reference_record", runs)], 3.28)
        (axes,) = figure.axes
        self.assertEqual(sorted(axes.collections[0].get_offsets()[:, 1]), [3.2782, 3.2785, 3.2794])
        self.assertIn([3.28, 3.28], [list(line.get_ydata()) for line in axes.get_lines()])
        bound = records.upper_confidence_bound(records.summarize([3.2782, 3.2785, 3.2794]))
        ends = [y for line in axes.get_lines() for y in line.get_ydata()]
        self.assertTrue(any(abs(y - bound) < 1e-12 for y in ends))  # the bar reaches the bound
        self.assertTrue(any(abs(y - 3.2787) < 1e-12 for y in ends))  # from the mean
        legend = [text.get_text() for text in axes.get_legend().get_texts()]
        self.assertEqual(legend[:2], ["final val loss of a run", "target 3.28"])
        self.assertIn("99% upper confidence bound", legend[2])
        self.assertEqual(axes.get_ylabel(), "final val loss")
        (tick,) = [label.get_text() for label in axes.get_xticklabels()]
        self.assertIn("reference_record (n = 3)", tick)
        self.assertIn("t = -3.606, df = 2", tick)
        self.assertIn("p = 0.0345 (not < 0.01)", tick)
        self.assertEqual(suptitle(figure), "Final val loss against the target 3.28")

    def test_two_sets_and_welch(self):
        png = os.path.join(self.dir, "two.png")
        rc, _, err = self.command("stats", FIRST, SECOND, "--against", RECORD, FIRST, "--png", png)
        self.assertEqual(rc, 1)  # a run in both sets: refused before any plot
        self.assertIn("the same file", err)
        self.assertFalse(os.path.exists(png))
        self.assertEqual(self.command("stats", FIRST, SECOND, "--against", RECORD, "--png", png)[0], 0)
        self.assertGreater(os.path.getsize(png), 10000)
        figure = records.stats_figure([("A", [records.parse_log(FIRST), records.parse_log(SECOND)]),
                                       ("B", [records.parse_log(RECORD)])], 3.28)
        ticks = [label.get_text() for label in figure.axes[0].get_xticklabels()]
        self.assertIn("A (n = 2)", ticks[0])
        self.assertIn("B (n = 1)", ticks[1])
        self.assertIn("p = n/a (too few runs)", ticks[1])
        self.assertIn("B against A, Welch's two-sided test: mean B - mean A = 0.00105", suptitle(figure))


if __name__ == "__main__":
    unittest.main()
