#!/usr/bin/env python3
"""tools/records.py: the log parser on both log formats, the t statistics against known values,
the refusals (duplicate runs among them), the comparison table, the freeze round trip and the
generated tables; the plots are test_records_plots.py's, as they need matplotlib."""
import contextlib
import io
import math
import os
import shutil
import statistics
import sys
import tempfile
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
import records  # noqa: E402

REFERENCE = os.path.join(HERE, "data", "reference_record")
SHARED_REFERENCE = os.path.join(REPO, "..", "shared", "reference")
REFERENCE_LOGS = ("record24_8054c239_steps.txt", "record24_f528789a_steps.txt", "record25_692f80e0_steps.txt")
LOG_8054 = os.path.join(REFERENCE, REFERENCE_LOGS[0])
RULE = "=" * 100

# A log in our trainer's layout whose source text holds step-like decoys, one a whole step line.
OUR_LOG = f"""// ===== train_gpt.cu =====
// a log line looks like:
step:5/10 val_loss:9.9999 train_time:1ms step_avg:1.00ms
  std::snprintf(line, sizeof line, "step:%d/%d val_loss:%.4f train_time:%.0fms step_avg:%.2fms", step,
// step:3/10 train_time:7ms step_avg:2.33ms
{RULE}
Running CUDA driver 13.0, runtime 13.0, cuBLASLt 130000, NCCL 22703
| NVIDIA-SMI 580.00 |
{RULE}
embed.weight: 50304x768 bf16 wd_mul 1 lr_mul 75
step:0/10 val_loss:10.8258 train_time:0ms step_avg:0.03ms
step:1/10 train_time:150ms step_avg:150.00ms
 step:2/10 train_time:160ms step_avg:80.00ms
step:2/10 train_time:160ms step_avg:80.00ms
step:2/10 train_time:160ms step_avg:80.00ms trailing
step:5/10 val_loss:6.5000 train_time:400ms step_avg:80.00ms
step:10/10 train_time:800ms step_avg:80.00ms
step:10/10 val_loss:4.2500 train_time:810ms step_avg:81.00ms
peak memory allocated: 30000 MiB reserved: 40000 MiB
"""


def settings_log(final_loss, final_ms, source="// ===== train_gpt.cu =====\nint main() {}\n", settings=None,
                 shards=(("train-files", "corpus/train_000.bin", 2048, "00000000000000aa"),),
                 gpu="NVIDIA H200", num_iterations=10):
    """A log of our trainer's layout with its header: command, build, ranks, every setting, the shards."""
    flags = {"num-iterations": str(num_iterations), "matrix-optimizer": "muon", "seed": "0", "log-dir": "logs"}
    flags.update(settings or {})
    header = ["Running CUDA driver 13.0, runtime 13.0, cuBLASLt 130100, NCCL 22803", f"gpu: {gpu}",
              "command: build/train_gpt --num-iterations 10", "build: commit 0123abcd",
              "ranks: world size 1, ranks per node 1, launcher none"]
    header += [f"setting: {name}={value}" for name, value in flags.items()]
    header += [f"shard: {flag} {path} {size} bytes, token hash {digest}" for flag, path, size, digest in shards]
    header.append("self-check: 11 checks, 0 failed, 6.0 s")
    return source + RULE + "\n" + "\n".join(header) + "\n" + RULE + "\n" + step_log(num_iterations, final_loss, final_ms)


def step_log(num_iterations, final_loss, final_ms, finished=True):
    """A bare step-line log of a short run."""
    lines = [f"step:0/{num_iterations} val_loss:10.8258 train_time:0ms step_avg:0.03ms"]
    lines += [f"step:{s}/{num_iterations} train_time:{s * 100}ms step_avg:100.00ms" for s in range(1, num_iterations + 1)]
    if finished:
        lines.append(f"step:{num_iterations}/{num_iterations} val_loss:{final_loss} train_time:{final_ms}ms "
                     f"step_avg:{final_ms / num_iterations:.2f}ms")
    return "\n".join(lines) + "\n"


class TempDir(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def command(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = records.main(list(argv))
        return rc, out.getvalue(), err.getvalue()


class Parser(TempDir):
    def test_reference_step_lines(self):
        run = records.parse_log(LOG_8054)
        self.assertEqual(run.num_iterations, 1770)
        self.assertEqual([s for s, _, _ in run.val], list(range(0, 1751, 125)) + [1770])
        self.assertEqual(len(run.train), 1770)
        self.assertEqual(run.train[0], (1, 157))
        self.assertEqual(run.final(), (3.2782, 177930))

    def test_our_log_ignores_source_and_inexact_lines(self):
        run = records.parse_log(self.write("ours.txt", OUR_LOG))
        self.assertEqual(run.num_iterations, 10)
        self.assertEqual(run.val, [(0, 10.8258, 0), (5, 6.5, 400), (10, 4.25, 810)])
        self.assertEqual(run.train, [(1, 150), (2, 160), (10, 800)])
        self.assertEqual(run.final(), (4.25, 810))

    def test_unfinished_run_has_no_final(self):
        self.assertIsNone(records.parse_log(self.write("a.txt", step_log(10, 4.0, 900, finished=False))).final())

    def test_refuses_a_log_without_step_lines(self):
        with self.assertRaisesRegex(records.RecordError, "empty.txt: no step lines"):
            records.parse_log(self.write("empty.txt", "int main() { return 0; }\n"))

    def test_refuses_a_log_mixing_num_iterations(self):
        with self.assertRaisesRegex(records.RecordError, r"mixed.txt: step lines mix num_iterations \[10, 20\]"):
            records.parse_log(self.write("mixed.txt", step_log(10, 4.0, 900) + step_log(20, 4.0, 900)))

    @unittest.skipUnless(os.path.isdir(SHARED_REFERENCE), "../shared/reference is not here")
    def test_test_data_is_the_shared_reference(self):
        for name in os.listdir(REFERENCE):
            if name.endswith(".txt"):
                with open(os.path.join(REFERENCE, name), "rb") as a, open(os.path.join(SHARED_REFERENCE, name), "rb") as b:
                    self.assertEqual(a.read(), b.read(), name)


class Statistics(unittest.TestCase):
    def test_t_table(self):
        # Textbook t-table critical values (e.g. NIST/SEMATECH e-Handbook 1.4.2.10), read as CDFs.
        for t, df, cdf in ((-2.764, 10, 0.0100), (-1.812, 10, 0.0500), (-2.528, 20, 0.0100),
                           (2.086, 20, 0.9750), (-3.365, 5, 0.0100), (1.645e6, 3, 1.0)):
            self.assertAlmostEqual(records.t_cdf(t, df), cdf, delta=5e-5, msg=f"t={t} df={df}")

    def test_closed_forms(self):
        # df = 1 is Cauchy: 1/2 + atan(t)/pi; df = 2: 1/2 + t / (2 sqrt(2 + t^2)).
        for t in (-30.0, -3.6056, -1.0, -0.25, 0.0, 0.7, 2.5, 12.0):
            self.assertAlmostEqual(records.t_cdf(t, 1), 0.5 + math.atan(t) / math.pi, places=12)
            self.assertAlmostEqual(records.t_cdf(t, 2), 0.5 + t / (2 * math.sqrt(2 + t * t)), places=12)
        for x in (0.01, 0.3, 0.5, 0.9, 0.999):
            self.assertAlmostEqual(records.incomplete_beta(2.5, 1, x), x ** 2.5, places=12)
            self.assertAlmostEqual(records.incomplete_beta(1, 3.5, x), 1 - (1 - x) ** 3.5, places=12)

    def test_spec_reference_logs(self):
        # SPEC Part 2: the three logs of the recipe end at 3.2782, 3.2785 and 3.2794; times from the
        # reference README. Mean 3.2787, std sqrt(39e-8), t = -0.0013 / (std / sqrt 3), df = 2,
        # t^2 = 13 exactly, so the df = 2 closed form gives p = (1 - sqrt(13/15)) / 2 = 0.0345253.
        runs = records.finished_runs([REFERENCE])
        self.assertEqual(sorted(r.final()[0] for r in runs), [3.2782, 3.2785, 3.2794])
        loss = records.summarize([r.final()[0] for r in runs])
        self.assertAlmostEqual(loss.mean, 3.2787, places=12)
        self.assertAlmostEqual(loss.std, math.sqrt(39e-8), places=12)
        t, df, p = records.one_sample_less(loss, 3.28)
        self.assertAlmostEqual(t, -math.sqrt(13), places=9)
        self.assertEqual(df, 2)
        self.assertAlmostEqual(p, 0.5 + t / (2 * math.sqrt(2 + t * t)), places=9)
        self.assertAlmostEqual(p, (1 - math.sqrt(13 / 15)) / 2, places=12)
        self.assertAlmostEqual(statistics.fmean([r.final()[1] for r in runs]), (177930 + 178064 + 173789) / 3)

    def test_one_sample_degenerate_cases(self):
        self.assertTrue(all(map(math.isnan, records.one_sample_less(records.summarize([3.27]), 3.28))))
        self.assertEqual(records.one_sample_less(records.summarize([3.27, 3.27]), 3.28), (-math.inf, 1, 0.0))
        self.assertEqual(records.one_sample_less(records.summarize([3.29, 3.29]), 3.28), (math.inf, 1, 1.0))
        self.assertEqual(records.one_sample_less(records.summarize([3.28, 3.28]), 3.28)[2], 1.0)
        self.assertGreater(records.one_sample_less(records.summarize([3.29, 3.30, 3.31]), 3.28)[2], 0.95)

    def test_t_quantile(self):
        # The t-table's critical values again, now as quantiles (the table gives 3 decimals).
        for probability, df, t in ((0.99, 10, 2.764), (0.95, 10, 1.812), (0.99, 20, 2.528), (0.975, 20, 2.086),
                                   (0.99, 5, 3.365), (0.99, 2, 6.965), (0.01, 2, -6.965), (0.99, 1, 31.821)):
            self.assertAlmostEqual(records.t_quantile(probability, df), t, delta=5e-4, msg=f"{probability} df={df}")
        for probability in (1e-6, 0.2, 0.5, 0.9, 0.999999):
            self.assertAlmostEqual(records.t_cdf(records.t_quantile(probability, 3.5), 3.5), probability, places=12)

    def test_upper_confidence_bound_agrees_with_the_test(self):
        # The mean is below the target at p < 0.01 exactly when its 99% upper bound is: p = 0.01 at the bound.
        for losses in ((3.2782, 3.2785, 3.2794), (3.270, 3.272, 3.271, 3.275), (3.27, 3.29)):
            loss = records.summarize(losses)
            bound = records.upper_confidence_bound(loss)
            self.assertAlmostEqual(records.one_sample_less(loss, bound)[2], records.SIGNIFICANCE, places=12)
        self.assertAlmostEqual(records.upper_confidence_bound(records.summarize([3.2782, 3.2785, 3.2794])),
                               3.2787 + 6.964557 * math.sqrt(39e-8 / 3), places=6)
        self.assertTrue(math.isnan(records.upper_confidence_bound(records.summarize([3.27]))))

    def test_welch(self):
        # Equal n and variance: df = 2 (n - 1) = 2; t = 3 / sqrt(2); two-sided p = 1 - t / sqrt(2 + t^2)
        # from the df = 2 closed form: 0.167949.
        t, df, p = records.welch(records.summarize([1, 3]), records.summarize([4, 6]))
        self.assertAlmostEqual(t, 3 / math.sqrt(2), places=12)
        self.assertAlmostEqual(df, 2, places=12)
        self.assertAlmostEqual(p, 1 - t / math.sqrt(2 + t * t), places=9)
        # Unequal: var 1 / n 3 against var 50 / n 2; Welch-Satterthwaite by hand:
        # (1/3 + 25)^2 / ((1/3)^2 / 2 + 25^2 / 1) = 1.026753, t = 13 / sqrt(76/3) = 2.582838.
        t, df, p = records.welch(records.summarize([1, 2, 3]), records.summarize([10, 20]))
        self.assertAlmostEqual(df, 1.026753, places=6)
        self.assertAlmostEqual(t, 2.582838, places=6)
        self.assertAlmostEqual(p, 2 * (1 - records.t_cdf(t, df)), places=12)
        self.assertTrue(math.isnan(records.welch(records.summarize([1]), records.summarize([1, 2]))[2]))


class Commands(TempDir):
    def test_stats_table(self):
        rc, out, _ = self.command("stats", REFERENCE, "--target", "3.28")
        self.assertEqual(rc, 0)
        self.assertIn("| record25_692f80e0_steps.txt | 3.2794 | 173.789 |", out)
        # t = -0.0013 / (std / sqrt 3) = -sqrt(13) and df = 2, printed beside p.
        self.assertIn("| runs | steps | val loss mean | val loss std | t (mean < 3.28) | df | p | p < 0.01 |", out)
        self.assertIn("| 3 | 1770 | 3.27870 | 0.00062 | -3.606 | 2 | 0.0345 | no | 176.594 | 2.430 |", out)

    def test_stats_against(self):
        a = [self.write(f"a{i}.txt", step_log(10, loss, 900)) for i, loss in enumerate((3.0, 3.2))]
        b = [self.write(f"b{i}.txt", step_log(10, loss, 900 + 100 * i)) for i, loss in enumerate((3.3, 3.5))]
        rc, out, _ = self.command("stats", *a, "--against", *b, "--target", "3.4")
        self.assertEqual(rc, 0)
        # t = (3.1 - 3.4) / (0.14142 / sqrt 2) = -3, df = 1.
        self.assertIn("| A | 2 | 10 | 3.10000 | 0.14142 | -3.000 | 1 | 0.1024 | no | 0.900 | 0.000 |", out)
        self.assertIn("| val loss | 0.30000 | 2.121 | 2.00 | 0.1679 |", out)  # the df = 2 case above
        # A's times do not vary: t = 0.05 / sqrt(0.005 / 2) = 1, df = 1, Cauchy: p = 2 (1/2 - atan(1)/pi) = 0.5.
        self.assertIn("| train time (s) | 0.050 | 1.000 | 1.00 | 0.5000 |", out)

    def test_refuses_an_unfinished_run(self):
        path = self.write("cut.txt", step_log(10, 4.0, 900, finished=False))
        rc, _, err = self.command("stats", LOG_8054, path)
        self.assertEqual(rc, 1)
        self.assertIn("cut.txt: reached step 10/10 but has no val_loss line there", err)
        cut = self.write("cut5.txt", "\n".join(step_log(10, 4.0, 900).splitlines()[:6]) + "\n")
        rc, _, err = self.command("stats", LOG_8054, cut)
        self.assertIn("cut5.txt: did not finish: no final step:10/10 val_loss line (last step seen: 5)", err)

    def test_refuses_runs_of_different_targets(self):
        short = self.write("short.txt", step_log(860, 2.67, 900))
        rc, _, err = self.command("stats", LOG_8054, short)
        self.assertEqual(rc, 1)
        self.assertIn("runs mix targets: 860 steps in " + short + "; 1770 steps in " + LOG_8054, err)

    def test_refuses_a_run_with_a_self_check_fallback(self):
        # The fallback line in the header (between the rules), as the trainer writes it; the same
        # words quoted in the source above the first rule do not count.
        fallback = ("self-check fallback: flash attention failed here; this run uses its reference "
                    "(--attention reference): slower, and not a record run")
        source_quote = OUR_LOG.replace("// a log line looks like:", "// " + fallback)
        self.assertEqual(records.parse_log(self.write("quoted.txt", source_quote)).fallbacks, [])
        path = self.write("fallback.txt", source_quote.replace("| NVIDIA-SMI 580.00 |", "| NVIDIA-SMI 580.00 |\n" + fallback))
        self.assertEqual(records.parse_log(path).fallbacks, [fallback])
        rc, _, err = self.command("stats", LOG_8054, path)
        self.assertEqual(rc, 1)
        self.assertIn("fallback.txt: trained on a reference path, not a record run: " + fallback, err)

    def test_refuses_a_nan_loss(self):
        rc, _, err = self.command("stats", self.write("nan.txt", step_log(10, "nan", 900)))
        self.assertEqual(rc, 1)
        self.assertIn("nan.txt: final val_loss is nan", err)

    def test_compare_prints_aligned_steps(self):
        ours = self.write("ours.txt", OUR_LOG)
        rc, out, _ = self.command("compare", ours, LOG_8054)
        self.assertEqual(rc, 0)
        self.assertIn(f"{ours} against the record {LOG_8054}:", out)
        self.assertIn("note: ours runs 10 steps, the record 1770", out)
        self.assertIn("| 0 | 10.8258 | 10.8258 | +0.0000 | 0 | 0 | +0 |", out)
        self.assertNotIn("| 5 |", out)  # no validation at step 5 in the record

    def test_compare_takes_several_runs_against_one_record(self):
        first, second, record = (os.path.join(REFERENCE, n) for n in REFERENCE_LOGS)
        rc, out, _ = self.command("compare", first, second, record)
        self.assertEqual(rc, 0)
        self.assertIn(f"{first} against the record {record}:", out)
        self.assertIn(f"{second} against the record {record}:", out)
        self.assertIn("| 1770 | 3.2782 | 3.2794 | -0.0012 | 177930 | 173789 | +4141 |", out)
        self.assertIn("| 1770 | 3.2785 | 3.2794 | -0.0009 | 178064 | 173789 | +4275 |", out)

    def test_compare_labels_each_run_once(self):
        ours = self.write("ours.txt", OUR_LOG)
        rc, out, _ = self.command("compare", ours, LOG_8054, "--label", "mine")
        self.assertEqual(rc, 0)
        self.assertIn(f"mine ({ours}) against the record {LOG_8054}:", out)
        rc, _, err = self.command("compare", ours, LOG_8054, "--label", "a", "b")
        self.assertEqual(rc, 1)
        self.assertIn("--label names 2 runs, but 1 are compared: one label each", err)

    def test_compare_refuses_logs_without_common_validation(self):
        path = self.write("late.txt", "step:7/7 val_loss:4.0000 train_time:9ms step_avg:1.29ms\n")
        rc, _, err = self.command("compare", path, LOG_8054)
        self.assertEqual(rc, 1)
        self.assertIn("no validation step in common", err)

    def test_plots_without_matplotlib_name_the_package(self):
        # No matplotlib: only a plot fails, naming the packages; the tables are unaffected.
        png = os.path.join(self.dir, "x.png")
        with mock.patch.dict(sys.modules, dict.fromkeys(
                ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"))):
            for argv in (("compare", LOG_8054, LOG_8054, "--png", png), ("stats", REFERENCE, "--png", png)):
                rc, out, err = self.command(*argv)
                self.assertEqual((rc, out), (1, ""), argv)
                self.assertIn("the plots need matplotlib", err)
                self.assertIn("python3-matplotlib", err)
                self.assertIn("pip install matplotlib", err)
            self.assertEqual(self.command("stats", REFERENCE)[0], 0)
            self.assertEqual(self.command("compare", LOG_8054, LOG_8054)[0], 0)
        self.assertFalse(os.path.exists(png))


class Settings(TempDir):
    def test_the_header_is_read_back(self):
        run = records.parse_log(self.write("run.txt", settings_log(3.0, 900)))
        self.assertEqual(run.settings, {"num-iterations": "10", "matrix-optimizer": "muon", "seed": "0", "log-dir": "logs"})
        self.assertEqual(run.shards, [("train-files", "corpus/train_000.bin", 2048, "00000000000000aa")])
        self.assertEqual(run.header, {"gpu": "NVIDIA H200", "command": "build/train_gpt --num-iterations 10",
                                      "build": "commit 0123abcd", "ranks": "world size 1, ranks per node 1, launcher none"})
        self.assertEqual(run.data(), "train_000.bin")
        self.assertEqual(records.parse_log(LOG_8054).settings, {})

    def stats(self, *logs, target="2.67"):
        paths = [self.write(f"{name}.txt", text) for name, text in logs]
        return self.command("stats", *paths, *(["--target", target] if target else []))

    def test_refuses_to_pool_runs_of_another_flag(self):
        rc, _, err = self.stats(("a", settings_log(3.0, 900)),
                                ("b", settings_log(3.1, 900, settings={"matrix-optimizer": "rekls"})))
        self.assertEqual(rc, 1)
        self.assertIn("error: runs that differ pool into nothing: --matrix-optimizer: muon in a.txt; rekls in b.txt", err)

    def test_refuses_to_pool_runs_of_other_data(self):
        other = (("train-files", "corpus/train_000.bin", 2048, "00000000000000bb"),)
        rc, _, err = self.stats(("a", settings_log(3.0, 900)), ("b", settings_log(3.1, 900, shards=other)))
        self.assertEqual(rc, 1)
        self.assertIn("runs that differ pool into nothing: the data read (shard sizes and token hashes): "
                      "train-files:2048:00000000000000aa in a.txt; train-files:2048:00000000000000bb in b.txt", err)

    def test_pools_runs_that_differ_in_seed_folders_and_paths(self):
        moved = (("train-files", "/abs/corpus/train_000.bin", 2048, "00000000000000aa"),)
        rc, out, err = self.stats(("a", settings_log(3.0, 900)),
                                  ("b", settings_log(3.1, 900, settings={"seed": "7", "log-dir": "elsewhere",
                                                                         "train-files": "/abs/corpus/train_*.bin"},
                                                     shards=moved)))
        self.assertEqual((rc, err), (0, ""))
        self.assertNotIn("note:", out)

    def test_notes_pooled_gpus_and_logs_without_settings(self):
        rc, out, _ = self.stats(("a", settings_log(3.0, 900)), ("b", settings_log(3.1, 900, gpu="NVIDIA H100 80GB HBM3")),
                                ("c", step_log(10, 3.05, 950)))
        self.assertEqual(rc, 0)
        self.assertIn("note: c.txt: no settings in the log (an older trainer's, or another code's): whether these runs "
                      "share their flags and data is not checked\n", out)
        self.assertIn("note: train times pooled over GPU models: NVIDIA H200 (1 run), NVIDIA H100 80GB HBM3 (1 run), "
                      "(GPU not recorded) (1 run)\n", out)

    def test_the_default_target_is_fineweb_s_for_fineweb_runs_only(self):
        rc, _, err = self.stats(("a", settings_log(3.0, 900)), ("b", settings_log(3.1, 900)), target=None)
        self.assertEqual(rc, 1)
        self.assertIn("these runs trained on train_000.bin, not FineWeb: FineWeb's target 3.28 says nothing of them; "
                      "give theirs with --target", err)
        fineweb = (("train-files", "data/fineweb10B/fineweb_train_000001.bin", 2048, "00000000000000aa"),)
        rc, out, _ = self.stats(("c", settings_log(3.0, 900, shards=fineweb)),
                                ("d", settings_log(3.1, 900, shards=fineweb)), target=None)
        self.assertEqual(rc, 0)
        self.assertIn("| t (mean < 3.28) |", out)
        self.assertNotIn("note:", out)
        rc, out, _ = self.command("stats", self.write("e.txt", step_log(10, 3.0, 900)),
                                  self.write("f.txt", step_log(10, 3.1, 900)))
        self.assertEqual(rc, 0)
        self.assertIn("note: target 3.28, FineWeb's, assumed: not every log says what its run trained on", out)

    def test_a_record_folder_gives_its_own_target(self):
        # a record's folder: its README's target, not FineWeb's assumed (its logs need not say their data)
        a = self.write("records/2026-01-01_a/README.md", "# a\n\nTarget val loss: 3.2\n")
        self.write("records/2026-01-01_a/r0.txt", step_log(10, 3.0, 900))
        self.write("records/2026-01-01_a/r1.txt", step_log(10, 3.1, 900))
        folder = os.path.dirname(a)
        rc, out, _ = self.command("stats", folder)
        self.assertEqual(rc, 0)
        self.assertIn(f"note: target 3.2, from {folder}/README.md\n", out)
        self.assertIn("| t (mean < 3.2) |", out)
        rc, out, _ = self.command("stats", folder, "--target", "3.5")  # --target still decides
        self.assertIn("| t (mean < 3.5) |", out)
        self.assertNotIn("from " + folder, out)
        b = self.write("records/2026-01-02_b/README.md", "# b\n\nTarget val loss: 3.28\n")
        self.write("records/2026-01-02_b/r0.txt", step_log(10, 3.2, 900))
        rc, _, err = self.command("stats", folder, "--against", os.path.dirname(b))
        self.assertEqual(rc, 1)
        self.assertIn(f"the record folders name different targets ({folder}: 3.2, {os.path.dirname(b)}: 3.28): "
                      "give one with --target", err)

    def test_against_names_what_the_sets_differ_in(self):
        a = self.write("a.txt", settings_log(3.0, 900))
        b = self.write("b.txt", settings_log(3.1, 900, settings={"matrix-optimizer": "rekls"}))
        rc, out, _ = self.command("stats", a, "--against", b, "--target", "3.5")
        self.assertEqual(rc, 0)
        self.assertIn("note: A and B differ in --matrix-optimizer: muon in a.txt; rekls in b.txt\n", out)

    def test_against_reads_the_first_run_that_carries_settings_and_notes_other_gpus(self):
        a = [self.write("a0.txt", step_log(10, 3.05, 950)), self.write("a1.txt", settings_log(3.0, 900))]
        b = self.write("b.txt", settings_log(3.1, 900, settings={"muon-lr": "0.1"}, gpu="NVIDIA H100 80GB HBM3"))
        rc, out, _ = self.command("stats", *a, "--against", b, "--target", "3.5")
        self.assertEqual(rc, 0)
        self.assertIn("note: A and B differ in --muon-lr: (not recorded) in a1.txt; 0.1 in b.txt\n", out)
        self.assertIn("note: A ran on (GPU not recorded), NVIDIA H200, B on NVIDIA H100 80GB HBM3: the train times' "
                      "test compares GPUs too\n", out)

    def test_compare_notes_another_gpu(self):
        ours = self.write("ours.txt", settings_log(3.0, 900))
        record = self.write("record.txt", settings_log(3.1, 950, gpu="NVIDIA H100 80GB HBM3"))
        rc, out, _ = self.command("compare", ours, record)
        self.assertEqual(rc, 0)
        self.assertIn("note: ours ran on NVIDIA H200, the record on NVIDIA H100 80GB HBM3: their times are of other "
                      "GPUs\n", out)
        self.assertNotIn("differ in", out)

    def test_the_launcher_alone_does_not_part_runs(self):
        torchrun = settings_log(3.1, 900).replace("launcher none", "launcher torchrun")
        rc, _, err = self.stats(("a", settings_log(3.0, 900)), ("b", torchrun))
        self.assertEqual((rc, err), (0, ""))
        two = settings_log(3.1, 900).replace("world size 1, ranks per node 1", "world size 2, ranks per node 2")
        rc, _, err = self.stats(("c", settings_log(3.0, 900)), ("d", two))
        self.assertEqual(rc, 1)
        self.assertIn("the ranks: world size 1, ranks per node 1 in c.txt; world size 2, ranks per node 2 in d.txt", err)

    def test_a_tiny_p_is_not_printed_as_zero(self):
        self.assertEqual(records.p_text(3e-7), "< 1e-4")
        self.assertEqual(records.p_text(0.03456), "0.0346")
        self.assertEqual(records.p_text(float("nan")), "n/a")
        logs = [(f"r{i}", settings_log(2.0 + 0.001 * i, 900)) for i in range(5)]
        rc, out, _ = self.stats(*logs, target="3.0")
        self.assertEqual(rc, 0)
        self.assertIn("| < 1e-4 | yes |", out)

    def test_a_resume_that_changed_settings_or_kernels_pools_with_nothing(self):
        def resumed(rest):
            return settings_log(3.1, 900).replace("step:0/10 val_loss", f"resumed from ckpt/step_000005.ckpt at step 5{rest}\n"
                                                  "step:0/10 val_loss")
        kernels = "; its steps before ran other kernels: --matmul-algorithms was first, is qkv.dx=1"
        self.assertEqual(records.parse_log(self.write("k.txt", resumed(kernels))).resumed, (5, kernels[2:]))
        rc, _, _ = self.stats(("a", settings_log(3.0, 900)), ("b", resumed("")))  # the same settings: one run
        self.assertEqual(rc, 0)
        older = " (the newest step every rank holds: a later one's checkpoints are on some ranks only)"
        self.assertEqual(records.parse_log(self.write("o.txt", resumed(older))).resumed, (5, ""))
        self.assertEqual(records.parse_log(self.write("ok.txt", resumed(older + kernels))).resumed, (5, kernels[2:]))
        for rest in (kernels, ", with other settings: --num-iterations was 8, is 10"):
            rc, _, err = self.stats(("a", settings_log(3.0, 900)), ("b", resumed(rest)))
            self.assertEqual(rc, 1)
            self.assertIn("b.txt: resumed at step 5 from a run that differed (" + rest.lstrip(",; ") +
                          "): its steps ran two ways", err)
        ours, record = self.write("ours.txt", resumed(kernels)), self.write("record.txt", settings_log(3.0, 900))
        rc, out, _ = self.command("compare", ours, record)
        self.assertEqual(rc, 0)
        self.assertIn("note: ours resumed at step 5 from a run that differed: " + kernels[2:], out)

    def test_compare_notes_a_self_check_fallback(self):
        fallback = "self-check fallback: FP8 head failed here; this run uses its reference (--bf16-head)"
        ours = self.write("ours.txt", settings_log(3.0, 900).replace("self-check: 11", fallback + "\nself-check: 11"))
        rc, out, _ = self.command("compare", ours, self.write("record.txt", settings_log(3.0, 900)))
        self.assertEqual(rc, 0)
        self.assertIn("note: ours trained on a reference path where the self-check refused a fast one: " + fallback, out)

    def test_a_target_is_a_finite_loss_above_zero(self):
        for target in ("nan", "inf", "1e400", "0", "-1"):
            rc, _, err = self.stats(("a", settings_log(3.0, 900)), ("b", settings_log(3.1, 900)), target=target)
            self.assertEqual(rc, 1)
            self.assertIn("a val loss is a finite number above 0", err)

    def test_png_must_name_a_png_file(self):
        with self.assertRaises(SystemExit) as exit_status:
            self.command("stats", REFERENCE, "--png", "out.txt")
        self.assertEqual(exit_status.exception.code, 2)


class Duplicates(TempDir):
    """One run counted twice would pass for two independent runs: p = 0 for one file named twice."""

    def refusal(self, *argv):
        rc, out, err = self.command("stats", *argv)
        self.assertEqual((rc, out), (1, ""))
        return err

    def test_refuses_a_file_named_twice(self):
        self.assertIn(f"error: {LOG_8054} and {LOG_8054}: the same file, named twice; each run counts once",
                      self.refusal(LOG_8054, LOG_8054))

    def test_refuses_a_file_named_directly_and_through_its_folder(self):
        first = os.path.join(REFERENCE, REFERENCE_LOGS[0])
        self.assertIn(f"{first} and {first}: the same file", self.refusal(REFERENCE, LOG_8054))
        alias = os.path.join(self.dir, "alias.txt")
        os.symlink(LOG_8054, alias)
        self.assertIn(f"{LOG_8054} and {alias}: the same file", self.refusal(LOG_8054, alias))

    def test_refuses_two_copies_of_one_run(self):
        copy = os.path.join(self.dir, "copy.txt")
        shutil.copy(LOG_8054, copy)
        self.assertIn(f"{LOG_8054} and {copy}: the same run (identical step lines); each run counts once",
                      self.refusal(LOG_8054, copy))

    def test_refuses_a_full_log_beside_its_step_lines(self):
        # The reference's _steps.txt files are extracts of full logs: the same run by its measurements.
        full = self.write("run.txt", OUR_LOG)
        step_lines = [line for line in OUR_LOG.split(RULE)[-1].splitlines()
                      if records.VAL_LINE.fullmatch(line) or records.TRAIN_LINE.fullmatch(line)]
        steps = self.write("run_steps.txt", "\n".join(step_lines) + "\n")
        self.assertIn(f"{full} and {steps}: the same run", self.refusal(full, steps))

    def test_refuses_a_run_in_both_sets(self):
        self.assertIn(f"{LOG_8054} and {LOG_8054}: the same file",
                      self.refusal(LOG_8054, os.path.join(REFERENCE, REFERENCE_LOGS[2]), "--against", LOG_8054))

    def test_runs_that_differ_in_one_step_time_are_two_runs(self):
        with open(LOG_8054) as f:
            text = f.read()
        other = self.write("other.txt", text.replace("step:1/1770 train_time:157ms", "step:1/1770 train_time:158ms"))
        self.assertEqual(self.command("stats", LOG_8054, other)[0], 0)


class Freeze(TempDir):
    def test_inlines_each_header_once_at_its_first_inclusion(self):
        root = os.path.join(self.dir, "tree")
        for name, text in (("train_gpt.cu", '#include "kernels/a.cuh"\n#include "data/b.h"\n#include <vector>\nint main() {}\n'),
                           ("kernels/a.cuh", '#pragma once\n#include "data/b.h"\n#include <cstdio>\nint a;\n'),
                           ("data/b.h", "#pragma once\nint b;\n")):
            self.write(os.path.join("tree", name), text)
        frozen = records.single_file_trainer("x", read=records.tree_files(root))
        body = records.body_of_frozen(frozen).split("\n")
        self.assertEqual(body, ["// ===== kernels/a.cuh (inlined) =====",
                                "// ===== data/b.h (inlined) =====", "int b;", "// ===== end of data/b.h =====",
                                "#include <cstdio>", "int a;", "// ===== end of kernels/a.cuh =====",
                                "#include <vector>", "int main() {}", ""])

    def test_freezing_twice_gives_the_same_bytes(self):
        folders = [records.freeze("twice", "2025-01-02", 2.67, os.path.join(self.dir, str(i))) for i in range(2)]
        for name in ("train_gpt.cu", "README.md"):
            contents = []
            for folder in folders:
                with open(os.path.join(folder, name), "rb") as f:
                    contents.append(f.read())
            self.assertEqual(contents[0], contents[1], name)
        self.assertEqual(records.record_target(folders[0]), 2.67)
        readme = os.path.join(folders[0], "README.md")
        with open(readme) as f:
            text = f.read()
        for line, target in (("Target val loss: 2.67.", 2.67), ("Target val loss: 0", None)):
            with open(readme, "w") as f:
                f.write(text.replace("Target val loss: 2.67", line))
            if target:  # a full stop after the number is a sentence's, not a parse error
                self.assertEqual(records.record_target(folders[0]), target)
            else:
                with self.assertRaisesRegex(records.RecordError, "target val loss 0: a val loss is a finite number"):
                    records.record_target(folders[0])
        with open(readme, "w") as f:
            f.write(text)
        with open(os.path.join(folders[0], "train_gpt.cu")) as f:
            frozen = f.read()
        self.assertEqual(frozen.split("\n")[2], "//   " + records.BUILD_COMMAND)
        self.assertIn(" -lcusolver ", records.BUILD_COMMAND)  # REKLS's eigensolver: without it the link fails
        self.assertEqual(frozen.split("\n")[3], '#define SPEEDRUN_FROZEN_RECORD "2025-01-02_twice"')
        self.assertNotRegex(frozen, r'#\s*include\s+"(kernels|data)/')
        self.assertNotRegex(frozen, r"#\s*pragma\s+once")
        body = records.body_of_frozen(frozen)
        self.assertEqual(body.count("// ===== kernels/host/cuda_check.cuh (inlined) ====="), 1)
        self.assertIn("#include <cublasLt.h>", body)
        # The text above the marker is embedded whole, as the raw string that the run logs.
        above, embedding = frozen.split(records.EMBED_MARKER + "\n")
        self.assertEqual(embedding, f'const char kTrainerSource[] = R"speedrun_source({above})speedrun_source";\n')

    def test_refuses_an_impossible_date_and_a_target_that_is_no_loss(self):
        for date in ("2025-02-30", "2025-1-02", "yesterday"):
            with self.assertRaisesRegex(records.RecordError, f"--date {date}: not a date"):
                records.freeze("x", date, 3.28, self.dir)
        for target in (float("nan"), float("inf"), -1.0, 0.0):
            with self.assertRaisesRegex(records.RecordError, "a val loss is a finite number above 0"):
                records.freeze("x", "2025-01-02", target, self.dir)
        self.assertEqual(os.listdir(self.dir), [])

    def write_tree(self, name, files):
        for path, text in files.items():
            self.write(os.path.join(name, path), text)
        return os.path.join(self.dir, name)

    def test_freezes_the_code_a_log_carries(self):
        files = {"train_gpt.cu": '#include "kernels/a.cuh"\nint main() {}\n',
                 "kernels/a.cuh": "#pragma once\nint a;\n", "kernels/unused.cuh": "#pragma once\nint u;\n"}
        tree = self.write_tree("tree", files)
        # The source as CMake embeds it: train_gpt.cu, then every header, each under its path.
        source = "".join(f"// ===== {path} =====\n{text}" for path, text in files.items())
        log = self.write("run.txt", settings_log(3.0, 900, source=source))
        from_log = records.freeze("logged", "2025-01-02", 2.67, os.path.join(self.dir, "a"), from_logs=[log])
        from_tree = records.freeze("logged", "2025-01-02", 2.67, os.path.join(self.dir, "b"), root=tree)
        texts = []
        for folder in (from_log, from_tree):
            with open(os.path.join(folder, "train_gpt.cu")) as f:
                texts.append(f.read())
        self.assertEqual(texts[0], texts[1])
        # A run of the frozen file logs the text above its marker: the same code again.
        above = texts[0].split(records.EMBED_MARKER)[0]
        frozen_run = self.write("frozen_run.txt", settings_log(3.1, 901, source=above))
        self.assertEqual(records.log_code([log, frozen_run]), records.body_of_frozen(texts[0]))

    def test_refuses_logs_of_two_codes_and_logs_without_source(self):
        one = self.write("one.txt", settings_log(3.0, 900, source="// ===== train_gpt.cu =====\nint main() {}\n"))
        two = self.write("two.txt", settings_log(3.1, 900, source="// ===== train_gpt.cu =====\nint main() { return 1; }\n"))
        with self.assertRaisesRegex(records.RecordError, "built from 2 different sources"):
            records.freeze("x", "2025-01-02", 2.67, self.dir, from_logs=[one, two])
        bare = self.write("bare.txt", step_log(10, 3.0, 900))
        with self.assertRaisesRegex(records.RecordError, "bare.txt: carries no source of this trainer"):
            records.freeze("x", "2025-01-02", 2.67, self.dir, from_logs=[bare])
        missing = self.write("missing.txt", settings_log(
            3.0, 900, source='// ===== train_gpt.cu =====\n#include "kernels/gone.cuh"\n'))
        with self.assertRaisesRegex(records.RecordError, "includes kernels/gone.cuh, which the log does not carry"):
            records.freeze("x", "2025-01-02", 2.67, self.dir, from_logs=[missing])
        self.assertEqual(sorted(os.listdir(self.dir)), ["bare.txt", "missing.txt", "one.txt", "two.txt"])

    def test_refuses_an_existing_record_and_a_bad_name(self):
        records.freeze("once", "2025-01-02", 3.28, self.dir)
        with self.assertRaisesRegex(records.RecordError, "already exists"):
            records.freeze("once", "2025-01-02", 3.28, self.dir)
        with self.assertRaisesRegex(records.RecordError, "not a record folder name"):
            records.freeze("a/b", "2025-01-02", 3.28, self.dir)


class Tables(TempDir):
    def test_committed_tables_are_up_to_date(self):
        self.assertEqual(records.update_tables(check=True), [],
                         "run `python3 tools/records.py table` and commit the result")
        with open(os.path.join(REFERENCE, "README.md")) as f:
            readme = f.read()
        results = records.stats_report(records.finished_runs([REFERENCE]), records.record_target(REFERENCE))
        self.assertEqual(records.with_block(readme, results, REFERENCE), readme)

    def test_tables_of_a_record_folder(self):
        self.write("README.md", f"# top\n{records.TABLE_BEGIN}\nstale\n{records.TABLE_END}\n")
        records_dir = os.path.join(self.dir, "records")
        folder = records.freeze("reference", "2025-07-13", 3.28, records_dir)
        records.freeze("empty", "2025-07-14", 2.67, records_dir)
        with open(os.path.join(folder, "train_gpt.cu")) as f:
            code = f.read().split(records.EMBED_MARKER)[0]  # what a run of the frozen file logs
        # The three reference runs' final losses and times, in logs of the record's code.
        for i, (loss, ms) in enumerate(((3.2782, 177930), (3.2785, 178064), (3.2794, 173789))):
            self.write(f"records/2025-07-13_reference/run{i}.txt",
                       settings_log(loss, ms, source=code, num_iterations=1770))
        # A new record's README is current until it has logs.
        self.assertEqual(records.update_tables(self.dir), [os.path.join(self.dir, "README.md"),
                                                           os.path.join(folder, "README.md")])
        self.assertEqual(records.update_tables(self.dir, check=True), [])
        with open(os.path.join(self.dir, "README.md")) as f:
            top = f.read()
        self.assertIn("| [2025-07-13_reference](records/2025-07-13_reference/) | 3.28 | 3 | 1770 | 3.27870 | 0.00062 | -3.606 | 2 | 0.0345 |", top)
        self.assertIn("| [2025-07-14_empty](records/2025-07-14_empty/) | 2.67 | 0 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |\n", top)
        with open(os.path.join(folder, "README.md")) as f:
            self.assertIn("| 3 | 1770 | 3.27870 | 0.00062 | -3.606 | 2 | 0.0345 | no | 176.594 | 2.430 |", f.read())
        # A log of other code (the working tree's, say) is not a run of the record.
        self.write("records/2025-07-13_reference/other.txt", settings_log(3.2790, 175000))
        with self.assertRaisesRegex(records.RecordError, "other.txt: was not built from .*2025-07-13_reference/train_gpt.cu"):
            records.update_tables(self.dir)


if __name__ == "__main__":
    unittest.main()
