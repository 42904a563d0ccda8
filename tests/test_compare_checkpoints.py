"""tools/compare_checkpoints.py on checkpoints written here in the trainer's format
(tests/checkpoint_files.py; test_trainer_host holds the trainer to the same bytes): the errors it
reports per parameter, the bound, and the files it refuses. Exits 77 (skipped) without numpy."""
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy  # noqa: F401
except ImportError:
    print("numpy is missing (tools/compare_checkpoints.py needs it): skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import checkpoint_files  # noqa: E402
import compare_checkpoints  # noqa: E402
from checkpoint_files import TINY_EMBEDDINGS, TINY_LAYOUT, TINY_MASTERS, TINY_STEP  # noqa: E402

TOOL = os.path.join(HERE, "..", "tools", "compare_checkpoints.py")


class CompareCheckpointsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="compare_checkpoints_")
        self.addCleanup(shutil.rmtree, self.dir)

    def write(self, name, embeddings=TINY_EMBEDDINGS, masters=TINY_MASTERS, layout=TINY_LAYOUT, step=TINY_STEP):
        path = os.path.join(self.dir, name)
        checkpoint_files.write_checkpoint(path, step, checkpoint_files.parameter_blobs(embeddings, masters, layout))
        return path

    def run_tool(self, *args):
        result = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)
        return result.returncode, result.stdout, result.stderr

    def test_the_tiny_checkpoint_is_written_here_byte_for_byte(self):
        self.assertEqual(self.read_bytes(self.write("tiny.ckpt")), self.read_bytes(checkpoint_files.TINY_CHECKPOINT))

    def test_reads_parameters_by_the_layout(self):
        c = compare_checkpoints.Checkpoint(checkpoint_files.TINY_CHECKPOINT)
        self.assertEqual(c.step, 4)
        self.assertEqual(list(c.layout), ["embed.weight", "lm_head.weight", "scalars"])
        self.assertEqual(c.parameter("embed.weight").tolist(), TINY_EMBEDDINGS)  # exact in bf16
        self.assertEqual(c.parameter("lm_head.weight").tolist(), TINY_MASTERS[:6])
        self.assertEqual(c.parameter("scalars").tolist(), TINY_MASTERS[6:])

    def test_bf16_values_are_read_as_rounded(self):
        c = compare_checkpoints.Checkpoint(self.write("rounded.ckpt", embeddings=[1 + 2 ** -9, 3.14159, 0, 0, 0, 0]))
        self.assertEqual(c.parameter("embed.weight").tolist()[:2], [1.0, 3.140625])

    def test_equal_checkpoints_differ_by_zero(self):
        worst = compare_checkpoints.compare(self.write("a.ckpt"), [self.write("b.ckpt"), self.write("c.ckpt")])
        self.assertEqual({name: error for name, (error, _) in worst.items()},
                         {"embed.weight": 0.0, "lm_head.weight": 0.0, "scalars": 0.0})

    def test_relative_error_per_parameter_and_the_worst_candidate(self):
        reference = self.write("reference.ckpt")
        near = self.write("near.ckpt", masters=[m * 1.001 for m in TINY_MASTERS])
        scalars_off = list(TINY_MASTERS)
        scalars_off[7] = 0.75  # scalars (1, 0.5) -> (1, 0.75): ||(0, 0.25)|| / ||(1, 0.5)||
        far = self.write("far.ckpt", masters=scalars_off)
        worst = compare_checkpoints.compare(reference, [near, far])
        self.assertEqual(worst["embed.weight"][0], 0.0)
        self.assertAlmostEqual(worst["lm_head.weight"][0], 1e-3, places=6)
        self.assertEqual(worst["lm_head.weight"][1], near)
        self.assertAlmostEqual(worst["scalars"][0], 0.25 / math.sqrt(1.25), places=7)
        self.assertEqual(worst["scalars"][1], far)

    def test_zero_reference_and_non_finite_values(self):
        zero_head = [0.0] * 6 + TINY_MASTERS[6:]
        reference = self.write("zero.ckpt", masters=zero_head)
        self.assertEqual(compare_checkpoints.compare(reference, [self.write("same.ckpt", masters=zero_head)])
                         ["lm_head.weight"][0], 0.0)
        moved = self.write("moved.ckpt", masters=[0.0] * 5 + [1e-3] + TINY_MASTERS[6:])
        self.assertEqual(compare_checkpoints.compare(reference, [moved])["lm_head.weight"][0], math.inf)
        nan = self.write("nan.ckpt", embeddings=[math.nan] + TINY_EMBEDDINGS[1:])
        self.assertEqual(compare_checkpoints.compare(self.write("r.ckpt"), [nan])["embed.weight"][0], math.inf)

    def test_the_last_line_and_the_exit_status_follow_the_bound(self):
        reference = self.write("reference.ckpt")
        candidate = self.write("candidate.ckpt", masters=[m * 1.05 for m in TINY_MASTERS])
        status, out, _ = self.run_tool("--bound", "0.1", reference, candidate)
        self.assertEqual(status, 0, out)
        self.assertIn("| lm_head.weight | 5.000e-02 | " + candidate + " |", out)
        self.assertEqual(out.splitlines()[-1],
                         f"worst relative error 5.000e-02 (lm_head.weight, {candidate}), bound 0.1: ok")
        status, out, _ = self.run_tool("--bound", "0.01", reference, candidate)
        self.assertEqual(status, 1)
        self.assertTrue(out.splitlines()[-1].endswith("bound 0.01: FAILED"), out)

    def test_refuses_what_it_cannot_compare(self):
        reference = self.write("reference.ckpt")
        cases = {
            "another step": (self.write("step5.ckpt", step=5), "step 5, the reference's is 4"),
            "another layout": (self.write("layout.ckpt", layout=TINY_LAYOUT.replace("scalars", "skips")),
                               "another parameter layout"),
            "no layout": (self.write_without_layout("old.ckpt"), "no 'parameter layout' blob (written before"),
            "not a checkpoint": (self.write_bytes("text.ckpt", b"not a checkpoint at all"), "bad magic"),
            "truncated": (self.write_bytes("cut.ckpt", self.read_bytes(reference)[:-12]), "truncated checkpoint"),
        }
        for case, (path, message) in cases.items():
            with self.subTest(case):
                status, _, err = self.run_tool(reference, path)
                self.assertEqual(status, 2, err)
                self.assertIn(message, err)
        status, _, err = self.run_tool(reference, os.path.join(self.dir, "missing.ckpt"))
        self.assertEqual(status, 2)
        self.assertIn("missing.ckpt", err)

    def write_without_layout(self, name):
        path = os.path.join(self.dir, name)
        blobs = checkpoint_files.parameter_blobs(TINY_EMBEDDINGS, TINY_MASTERS, TINY_LAYOUT)[:-1]
        checkpoint_files.write_checkpoint(path, TINY_STEP, blobs)
        return path

    @staticmethod
    def read_bytes(path):
        with open(path, "rb") as f:
            return f.read()

    def write_bytes(self, name, data):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        return path


if __name__ == "__main__":
    unittest.main(buffer=True)
