#!/usr/bin/env python3
"""tools/records.py: the log parser on both log formats, the t statistics against known values,
the refusals, the comparison and its PNG, the freeze round trip and the generated tables."""
import contextlib
import io
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import unittest
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tools"))
import records  # noqa: E402

REFERENCE = os.path.join(HERE, "data", "reference_record")
SHARED_REFERENCE = os.path.join(REPO, "..", "shared", "reference")
LOG_8054 = os.path.join(REFERENCE, "record24_8054c239_steps.txt")
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
        t = (3.2787 - 3.28) / (math.sqrt(39e-8) / math.sqrt(3))
        p = records.one_sample_less_p(loss, 3.28)
        self.assertAlmostEqual(p, 0.5 + t / (2 * math.sqrt(2 + t * t)), places=9)
        self.assertAlmostEqual(p, (1 - math.sqrt(13 / 15)) / 2, places=12)
        self.assertAlmostEqual(statistics.fmean([r.final()[1] for r in runs]), (177930 + 178064 + 173789) / 3)

    def test_one_sample_degenerate_cases(self):
        self.assertTrue(math.isnan(records.one_sample_less_p(records.summarize([3.27]), 3.28)))
        self.assertEqual(records.one_sample_less_p(records.summarize([3.27, 3.27]), 3.28), 0.0)
        self.assertEqual(records.one_sample_less_p(records.summarize([3.29, 3.29]), 3.28), 1.0)
        self.assertGreater(records.one_sample_less_p(records.summarize([3.29, 3.30, 3.31]), 3.28), 0.95)

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
        self.assertIn("| 3 | 1770 | 3.27870 | 0.00062 | 0.0345 | no | 176.594 | 2.430 |", out)

    def test_stats_against(self):
        a = [self.write(f"a{i}.txt", step_log(10, loss, 900)) for i, loss in enumerate((3.0, 3.2))]
        b = [self.write(f"b{i}.txt", step_log(10, loss, 900 + 100 * i)) for i, loss in enumerate((3.3, 3.5))]
        rc, out, _ = self.command("stats", *a, "--against", *b, "--target", "3.4")
        self.assertEqual(rc, 0)
        self.assertIn("| A | 2 | 10 | 3.10000 | 0.14142 | 0.1024 | no | 0.900 | 0.000 |", out)
        self.assertIn("| val loss | 0.30000 | 2.121 | 2.00 | 0.1679 |", out)  # the df = 2 case above
        # A's times do not vary: t = 0.05 / sqrt(0.005 / 2) = 1, df = 1, Cauchy: p = 2 (1/2 - atan(1)/pi) = 0.5.
        self.assertIn("| train time (s) | 0.050 | 1.000 | 1.00 | 0.5000 |", out)

    def test_refuses_an_unfinished_run(self):
        path = self.write("cut.txt", step_log(10, 4.0, 900, finished=False))
        rc, _, err = self.command("stats", LOG_8054, path)
        self.assertEqual(rc, 1)
        self.assertIn("cut.txt: did not finish: no final step:10/10 val_loss line (last step seen: 10)", err)

    def test_refuses_runs_of_different_targets(self):
        short = self.write("short.txt", step_log(860, 2.67, 900))
        rc, _, err = self.command("stats", LOG_8054, short)
        self.assertEqual(rc, 1)
        self.assertIn("runs mix targets: 860 steps in " + short + "; 1770 steps in " + LOG_8054, err)

    def test_refuses_a_nan_loss(self):
        rc, _, err = self.command("stats", self.write("nan.txt", step_log(10, "nan", 900)))
        self.assertEqual(rc, 1)
        self.assertIn("nan.txt: final val_loss is nan", err)

    def test_compare_prints_aligned_steps_and_writes_a_png(self):
        ours, png = self.write("ours.txt", OUR_LOG), os.path.join(self.dir, "cmp.png")
        rc, out, _ = self.command("compare", ours, LOG_8054, "--png", png)
        self.assertEqual(rc, 0)
        self.assertIn("note: ours runs 10 steps, the record 1770", out)
        self.assertIn("| 0 | 10.8258 | 10.8258 | +0.0000 | 0 | 0 | +0 |", out)
        self.assertNotIn("| 5 |", out)  # no validation at step 5 in the record
        self.assertIn("blue: ours", out)
        pixels = read_png(self, png)
        self.assertIn(bytes(records.OURS_COLOUR), pixels)
        self.assertIn(bytes(records.RECORD_COLOUR), pixels)

    def test_compare_refuses_logs_without_common_validation(self):
        path = self.write("late.txt", "step:7/7 val_loss:4.0000 train_time:9ms step_avg:1.29ms\n")
        rc, _, err = self.command("compare", path, LOG_8054, "--png", os.path.join(self.dir, "x.png"))
        self.assertEqual(rc, 1)
        self.assertIn("no validation step in common", err)


def read_png(test, path):
    """Checks signature, chunk CRCs, IHDR (8-bit RGB) and filter bytes; returns the raw pixels."""
    with open(path, "rb") as f:
        data = f.read()
    test.assertEqual(data[:8], b"\x89PNG\r\n\x1a\n")
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        test.assertEqual(crc, zlib.crc32(kind + body), kind)
        chunks.append((kind, body))
        pos += 12 + length
    test.assertEqual([k for k, _ in chunks], [b"IHDR", b"IDAT", b"IEND"])
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    test.assertEqual((depth, colour), (8, 2))
    raw = zlib.decompress(chunks[1][1])
    stride = 1 + 3 * width
    test.assertEqual(len(raw), height * stride)
    test.assertEqual({raw[y * stride] for y in range(height)}, {0})
    return b"".join(raw[y * stride + 1:(y + 1) * stride] for y in range(height))


class Freeze(TempDir):
    def test_inlines_each_header_once_at_its_first_inclusion(self):
        root = os.path.join(self.dir, "tree")
        for name, text in (("train_gpt.cu", '#include "kernels/a.cuh"\n#include "data/b.h"\n#include <vector>\nint main() {}\n'),
                           ("kernels/a.cuh", '#pragma once\n#include "data/b.h"\n#include <cstdio>\nint a;\n'),
                           ("data/b.h", "#pragma once\nint b;\n")):
            self.write(os.path.join("tree", name), text)
        body = records.single_file_trainer(root).split("\n")[3:]
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
        with open(os.path.join(folders[0], "train_gpt.cu")) as f:
            frozen = f.read()
        self.assertIn(records.BUILD_COMMAND, frozen.split("\n")[2])
        self.assertNotRegex(frozen, r'#\s*include\s+"(kernels|data)/')
        self.assertNotRegex(frozen, r"#\s*pragma\s+once")
        self.assertEqual(frozen.count("// ===== kernels/cuda_check.cuh (inlined) ====="), 1)
        self.assertIn("#include <cublasLt.h>", frozen)

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
        self.assertEqual(records.with_block(readme, records.record_results(REFERENCE), REFERENCE), readme)

    def test_tables_of_a_record_folder(self):
        self.write("README.md", f"# top\n{records.TABLE_BEGIN}\nstale\n{records.TABLE_END}\n")
        records_dir = os.path.join(self.dir, "records")
        folder = records.freeze("reference", "2025-07-13", 3.28, records_dir)
        records.freeze("empty", "2025-07-14", 2.67, records_dir)
        for name in os.listdir(REFERENCE):
            if name.endswith(".txt"):
                shutil.copy(os.path.join(REFERENCE, name), folder)
        # A new record's README is current until it has logs.
        self.assertEqual(records.update_tables(self.dir), [os.path.join(self.dir, "README.md"),
                                                           os.path.join(folder, "README.md")])
        self.assertEqual(records.update_tables(self.dir, check=True), [])
        with open(os.path.join(self.dir, "README.md")) as f:
            top = f.read()
        self.assertIn("| [2025-07-13_reference](records/2025-07-13_reference/) | 3.28 | 3 | 1770 | 3.27870 | 0.00062 | 0.0345 |", top)
        self.assertIn("| [2025-07-14_empty](records/2025-07-14_empty/) | 2.67 | 0 | n/a |", top)
        with open(os.path.join(folder, "README.md")) as f:
            self.assertIn("| 3 | 1770 | 3.27870 | 0.00062 | 0.0345 | no | 176.594 | 2.430 |", f.read())


if __name__ == "__main__":
    unittest.main()
