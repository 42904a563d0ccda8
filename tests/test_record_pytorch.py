#!/usr/bin/env python3
"""tools/record_pytorch.py without a GPU: each patch on a small stand-in for the record's file (the
texts it replaces, as record #25 has them, around stubs), a file whose text differs refused naming
the patch, the refusals before any GPU work (a glob matching nothing, a missing file, no torch, no
CUDA, no triton), and a whole run of the patched stand-in in-process with stand-in torch and triton
modules: its overrides, its log and what it called, step by step. Where ../shared/anchor holds the
real record, every combination of patches applies to it and compiles."""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "tools", "record_pytorch.py")
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import record_pytorch  # noqa: E402

# The record's texts that the patches replace, around stubs that log what is called: the long ones
# (the profiler block, the training step) are the tool's own copies, which the last test holds
# against the real file where it is beside the checkout.
STAND_IN = '''\
import os
import sys
with open(sys.argv[0]) as f:
    code = f.read() # read the code of this file ASAP, for logging
import itertools
import time
import torch
from dataclasses import dataclass

@dataclass
class Hyperparameters:
    train_files = "data/fineweb10B/fineweb_train_*.bin"
    val_files = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens = 10485760
    num_iterations = 1770
    val_loss_every = 125
args = Hyperparameters()

rank = 0
logfile = None
if rank == 0:
    run_id = "standin"
    os.makedirs("logs", exist_ok=True)
    logfile = f"logs/{run_id}.txt"
def print0(s):
    with open(logfile, "a") as f:
        print(s, file=f)
print0(code)
print0("=" * 100)
print0(f"args: {args.train_files} {args.val_files} {args.num_iterations} {args.val_loss_every} {args.val_tokens}")
print0(f"environment: {os.environ['RANK']} {os.environ['WORLD_SIZE']} {os.environ['LOCAL_RANK']}")

events = []
class Loss:
    def __truediv__(self, m):
        events.append(f"/{m}")
        return self
    def backward(self):
        events.append("backward")
class Model:
    def __call__(self, inputs, targets, window):
        events.append(f"model({inputs},w{window})")
        return Loss()
    def zero_grad(self, set_to_none):
        events.append("zero_grad")
class Optimizer:
    def step(self):
        events.append("opt")
model = Model()
optimizers = [Optimizer()]
def get_window_size_blocks(step):
    return step
train_loader = ((i, i) for i in itertools.count())
warmup_steps = 10
torch.cuda.synchronize()
PROFILER_BLOCK
training_time_ms = 0
t0 = time.perf_counter()
train_steps = args.num_iterations
for step in range(train_steps + 1):
    last_step = (step == train_steps)
    # --------------- VALIDATION SECTION -----------------
    if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
        events.append(f"validation{step}")
        print0(f"step:{step}/{train_steps} val_loss:1.0000 train_time:0ms step_avg:0.00ms")
    if last_step:
        break

    # --------------- TRAINING SECTION -----------------
TRAINING_STEP    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    # logging
    approx_training_time_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
    events.append(f"line{step + 1}")
print0("events: " + " ".join(events))
print0("torch: " + " ".join(torch.calls))
'''.replace("PROFILER_BLOCK", record_pytorch.PROFILER_BLOCK).replace("TRAINING_STEP", record_pytorch.TRAINING_STEP)

# Stand-in modules: torch records the calls the patches add; FAKE_TORCH picks what is missing.
FAKE_TORCH = '''\
import os
__version__ = "2.11.0+fake"
calls = []
which = os.environ.get("FAKE_TORCH", "ok")
if which == "missing":
    raise ImportError("No module named 'torch' (stand-in)")
class cuda:
    @staticmethod
    def is_available():
        return which != "no-cuda"
    @staticmethod
    def synchronize():
        calls.append("sync")
    class profiler:
        @staticmethod
        def start():
            calls.append("start")
        @staticmethod
        def stop():
            calls.append("stop")
'''
FAKE_TRITON = '''\
import os
if os.environ.get("FAKE_TORCH") == "no-triton":
    raise ImportError("No module named 'triton' (stand-in)")
'''


class RecordPytorchTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="record_pytorch_")
        self.addCleanup(subprocess.run, ["rm", "-rf", self.dir])
        self.modules = os.path.join(self.dir, "modules")
        os.makedirs(self.modules)
        for name, text in (("torch.py", FAKE_TORCH), ("triton.py", FAKE_TRITON)):
            with open(os.path.join(self.modules, name), "w") as f:
                f.write(text)
        self.record = self.write("train_gpt.py", STAND_IN)
        self.data = self.write("shard_000001.bin", "")

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def run_tool(self, *args, torch="ok", record=None):
        command = [sys.executable, TOOL, "--record", record or self.record, "--train-files", self.data,
                   "--val-files", self.data, "--log-dir", os.path.join(self.dir, "logs"), *args]
        env = dict(os.environ, PYTHONPATH=self.modules, FAKE_TORCH=torch)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=self.dir)
        return result.returncode, result.stdout + result.stderr

    def log(self):
        with open(os.path.join(self.dir, "logs", "standin.txt")) as f:
            return f.read()

    def line(self, prefix):
        return next(line for line in self.log().splitlines() if line.startswith(prefix))

    def test_m_micro_batches_a_profiled_step_synchronised_lines_no_validation(self):
        status, output = self.run_tool("--num-iterations", "3", "--micro-batches", "2", "--sync-steps",
                                       "--profile-step", "2", "--no-validation")
        self.assertEqual(status, 0, output)
        self.assertEqual(self.line("args: "), f"args: {self.data} {self.data} 3 0 10485760")
        self.assertEqual(self.line("environment: "), "environment: 0 1 0")
        # the profiler block's 10 warm-up steps are gone; each step takes two batches, each loss / 2
        step = lambda i, a, b: (f"model({a},w{i}) /2 backward model({b},w{i}) /2 backward opt zero_grad "
                                f"line{i + 1}")
        self.assertEqual(self.line("events: "), "events: " + " ".join([step(0, 0, 1), step(1, 2, 3), step(2, 4, 5)]))
        # the stand-in's own sync first; then a sync before each step line, step 2 inside start/stop
        self.assertEqual(self.line("torch: "), "torch: sync sync sync start sync stop sync sync")
        log = self.log()
        self.assertTrue(log.startswith(f"# Run by tools/record_pytorch.py from {self.record} (sha256 "), log[:200])
        self.assertIn("code = __record_source__  # tools/record_pytorch.py: the patched text, as it ran", log)
        self.assertNotIn("torch.profiler.profile()", log)

    def test_m_1_leaves_the_step_and_validates(self):
        status, output = self.run_tool("--num-iterations", "2", "--val-every", "1")
        self.assertEqual(status, 0, output)
        self.assertEqual(self.line("events: "), "events: validation0 model(0,w0) backward opt zero_grad line1 "
                                                "validation1 model(1,w1) backward opt zero_grad line2 validation2")
        self.assertEqual(self.line("torch: "), "torch: sync")

    def test_a_file_whose_text_differs_is_refused_naming_the_patch(self):
        cases = (
            (STAND_IN.replace("    model(inputs, targets, get_window_size_blocks(step)).backward()\n", ""),
             "the patch 'M micro-batches per step' expects its text exactly once, found 0 times"),
            (STAND_IN.replace('prof.export_chrome_trace(f"traces/trace_{rank}.json")\n', ""),
             "the patch 'the profiler block dropped' expects its text exactly once, found 0 times"),
            (STAND_IN + "args = Hyperparameters()\n",
             "the patch 'hyperparameters from the command line' expects its text exactly once, found 2 times"))
        for text, message in cases:
            with self.subTest(message=message):
                status, output = self.run_tool("--num-iterations", "2", record=self.write("other.py", text))
                self.assertEqual(status, 3, output)
                self.assertIn(f"error: {os.path.join(self.dir, 'other.py')}: {message}", output)
        with self.assertRaisesRegex(record_pytorch.PatchError, "'each step line synchronised'"):
            record_pytorch.patch(STAND_IN.replace("    # logging\n", "    # log\n"), sync_steps=True)

    def test_refusals_before_any_gpu_work(self):
        missing = os.path.join(self.dir, "nothing_*.bin")
        status, output = self.run_tool("--num-iterations", "2", "--train-files", missing)
        self.assertEqual((status, output.strip()), (3, f"error: --train-files '{missing}' matches no file"))
        status, output = self.run_tool("--num-iterations", "2", record=os.path.join(self.dir, "absent.py"))
        self.assertEqual(status, 3)
        self.assertIn("absent.py: No such file or directory", output)
        for torch, message in (("missing", "error: PyTorch is missing (No module named 'torch' (stand-in))"),
                               ("no-cuda", "error: PyTorch 2.11.0+fake sees no CUDA GPU"),
                               ("no-triton", "error: triton is missing (No module named 'triton' (stand-in))")):
            with self.subTest(torch=torch):
                status, output = self.run_tool("--num-iterations", "2", torch=torch)
                self.assertEqual(status, 4, output)
                self.assertIn(message, output)
        status, output = self.run_tool("--num-iterations", "2", "--profile-step", "3")
        self.assertEqual(status, 2)
        self.assertIn("--profile-step 3 is outside the run's steps 1..2", output)

    @unittest.skipUnless(os.path.exists(record_pytorch.DEFAULT_RECORD), "the record's file is not beside the checkout")
    def test_every_patch_applies_to_the_real_record(self):
        with open(record_pytorch.DEFAULT_RECORD) as f:
            source = f.read()
        for micro_batches in (1, 8):
            for sync_steps in (False, True):
                for validate in (False, True):
                    for profile_step in (0, 5):
                        patched = record_pytorch.patch(source, micro_batches, sync_steps, validate, profile_step)
                        compile(patched, "patched", "exec")
                        self.assertNotIn("torch.profiler.profile()", patched)


if __name__ == "__main__":
    unittest.main()
