#!/usr/bin/env python3
"""Record #25's own PyTorch code (modded-nanogpt's train_gpt.py) on one GPU, beside the trainer.

  python3 tools/record_pytorch.py --train-files 'corpus-bin/corpus_train_*.bin' \\
      --val-files 'corpus-bin/corpus_val_*.bin' --num-iterations 20 --micro-batches 8 --no-validation

The record's file (--record, default ../shared/anchor/record25/train_gpt.py) is third-party code:
it is read, patched in memory and run in this process, never copied. Each patch replaces a text
the file must hold exactly once; a file whose text differs is refused, naming the patch, so that a
patch never silently does nothing. The patches:
  - its log carries the patched text it ran (the record logs its own source);
  - data globs, --num-iterations, --val-every, --val-tokens set on its Hyperparameters;
  - its log goes to --log-dir;
  - the torch.profiler block (10 more warm-up steps and a trace file) dropped;
  - --micro-batches M: M batches from its loader per step, each (loss / M).backward(), then the
    optimizers once: the 8-GPU mathematics on one GPU (its reduce-scatters average over ranks);
    M = 1 leaves the step as it is;
  - --sync-steps: torch.cuda.synchronize() before each step line's time, so that each line's
    train_time is the GPU's, as the trainer's is (it synchronises on the loss every step);
  - --no-validation: no validation at the end (its eval graph compiles for a minute; speed runs);
  - --profile-step N: step N between cudaProfilerStart/Stop, the GPU idle at both ends, as the
    trainer's --profile-step (build/libkernel_profile.so).
Its log lines are the trainer's format (step:S/N ... train_time:...ms step_avg:...ms), into
--log-dir/<uuid>.txt. torch, CUDA and triton are checked first: exit 4 names what is missing;
exit 3: a data glob that matches nothing, a record file that is missing or not the expected text.
"""
import argparse
import glob
import hashlib
import linecache
import os
import shlex
import socket
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RECORD = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "anchor", "record25", "train_gpt.py"))
EXIT_BAD_INPUT, EXIT_NO_GPU = 3, 4


class PatchError(Exception):
    pass


PROFILER_BLOCK = '''with torch.profiler.profile() as prof:
    for _ in range(warmup_steps):
        inputs, targets = next(train_loader)
        model(inputs, targets, get_window_size_blocks(1)).backward()
        for opt in optimizers:
            opt.step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.barrier()
os.makedirs("traces", exist_ok=True)
prof.export_chrome_trace(f"traces/trace_{rank}.json")
'''

TRAINING_STEP = '''    inputs, targets = next(train_loader)
    model(inputs, targets, get_window_size_blocks(step)).backward()
'''

TRAINING_SECTION = "    # --------------- TRAINING SECTION -----------------\n"
STEP_LOGGING = "    # logging\n    approx_training_time_ms = training_time_ms + 1000 * (time.perf_counter() - t0)\n"
VALIDATION_TEST = "    if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):\n"


def patches(micro_batches, sync_steps, validate, profile_step):
    """[(name, expected text, replacement)], applied in order, each to the text the ones before left."""
    tag = "# tools/record_pytorch.py"
    out = [
        ("the log carries the patched source",
         "with open(sys.argv[0]) as f:\n    code = f.read() # read the code of this file ASAP, for logging\n",
         f"code = __record_source__  {tag}: the patched text, as it ran\n"),
        ("hyperparameters from the command line", "args = Hyperparameters()\n",
         f"args = Hyperparameters()\nfor _name, _value in __record_overrides__.items():  {tag}\n"
         "    assert hasattr(args, _name), _name\n    setattr(args, _name, _value)\n"),
        ("the log folder", '    os.makedirs("logs", exist_ok=True)\n    logfile = f"logs/{run_id}.txt"\n',
         f'    os.makedirs(__record_log_dir__, exist_ok=True)  {tag}\n    logfile = f"{{__record_log_dir__}}/{{run_id}}.txt"\n'),
        ("the profiler block dropped", PROFILER_BLOCK,
         f"{tag}: the torch.profiler block (10 more warm-up steps, traces/) dropped\n"),
        ("M micro-batches per step", TRAINING_STEP,
         TRAINING_STEP if micro_batches == 1 else
         f"    for _micro in range({micro_batches}):  {tag}: M micro-batches, the 8-GPU mathematics\n"
         "        inputs, targets = next(train_loader)\n"
         f"        (model(inputs, targets, get_window_size_blocks(step)) / {micro_batches}).backward()\n"),
    ]
    if not validate:
        out.append(("no validation", VALIDATION_TEST,
                    f"    if last_step:  {tag} --no-validation\n        break\n" + VALIDATION_TEST))
    if profile_step:
        out.append(("the profiled step's start", TRAINING_SECTION,
                    TRAINING_SECTION + f"    if step + 1 == {profile_step}:  {tag} --profile-step\n"
                    "        torch.cuda.synchronize()\n        torch.cuda.profiler.start()\n"))
        out.append(("the profiled step's end", STEP_LOGGING,
                    f"    if step + 1 == {profile_step}:  {tag} --profile-step\n"
                    "        torch.cuda.synchronize()\n        torch.cuda.profiler.stop()\n" + STEP_LOGGING))
    if sync_steps:
        out.append(("each step line synchronised", STEP_LOGGING,
                    f"    torch.cuda.synchronize()  {tag} --sync-steps: the GPU's time, as the trainer's\n" + STEP_LOGGING))
    return out


def patch(source, micro_batches=1, sync_steps=False, validate=True, profile_step=0, path="the record's file"):
    for name, expected, replacement in patches(micro_batches, sync_steps, validate, profile_step):
        count = source.count(expected)
        if count != 1:
            first = expected.strip().splitlines()[0]
            raise PatchError(f"{path}: the patch '{name}' expects its text exactly once, found {count} times: "
                             f"'{first}'... (not record #25's train_gpt.py at 3e121a6?)")
        source = source.replace(expected, replacement)
    return source


def environment_problem():
    """What keeps the record's code from running here, or None."""
    try:
        import torch
    except ImportError as e:
        return f"PyTorch is missing ({e}): the record's code needs torch with CUDA"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no CUDA GPU: the record's code needs one"
    try:
        import triton  # noqa: F401  (torch.compile's kernels)
    except ImportError as e:
        return f"triton is missing ({e}): torch.compile, which the record's code uses, needs it"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", default=DEFAULT_RECORD, help="the record's train_gpt.py (default: %(default)s)")
    parser.add_argument("--train-files", required=True, help="glob of training shards")
    parser.add_argument("--val-files", required=True, help="glob of validation shards")
    parser.add_argument("--num-iterations", type=int, required=True)
    parser.add_argument("--val-every", type=int, default=0, help="validation every N steps (0: at the end only)")
    parser.add_argument("--val-tokens", type=int, default=10485760)
    parser.add_argument("--micro-batches", type=int, default=1, help="M micro-sequences per step (8: the record's batch)")
    parser.add_argument("--sync-steps", action="store_true", help="synchronise before each step line's time")
    parser.add_argument("--no-validation", action="store_true", help="no validation at all (speed runs)")
    parser.add_argument("--profile-step", type=int, default=0, help="step N inside cudaProfilerStart/Stop (0: none)")
    parser.add_argument("--log-dir", default="logs")
    args = parser.parse_args(argv)
    if args.num_iterations < 1 or args.micro_batches < 1 or args.val_every < 0:
        parser.error("--num-iterations and --micro-batches must be positive, --val-every non-negative")
    if not 0 <= args.profile_step <= args.num_iterations:
        parser.error(f"--profile-step {args.profile_step} is outside the run's steps 1..{args.num_iterations}")
    for flag, pattern in (("--train-files", args.train_files), ("--val-files", args.val_files)):
        if not glob.glob(pattern):
            print(f"error: {flag} '{pattern}' matches no file", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        with open(args.record) as f:
            original = f.read()
    except OSError as e:
        print(f"error: --record {args.record}: {e.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        patched = patch(original, args.micro_batches, args.sync_steps, not args.no_validation, args.profile_step,
                        args.record)
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = environment_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    digest = hashlib.sha256(original.encode()).hexdigest()
    header = (f"# Run by tools/record_pytorch.py from {args.record} (sha256 {digest}), patched in memory as below:\n"
              f"# {shlex.join([sys.executable, *sys.argv])}\n")
    source = header + patched
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(name, value)
    overrides = dict(train_files=args.train_files, val_files=args.val_files, num_iterations=args.num_iterations,
                     val_loss_every=args.val_every, val_tokens=args.val_tokens)
    filename = os.path.abspath(args.record) + " (patched)"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks, dynamo
    sys.argv = [args.record]
    # A module of its own as __main__, as if the file had been run (dataclasses and pickling look
    # their module up in sys.modules). Its __file__ stays this tool's: a worker process that
    # re-imports the main module by its file then meets this file's main guard, not the record's
    # unpatched text.
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=os.path.abspath(__file__), __record_source__=source,
                           __record_overrides__=overrides, __record_log_dir__=args.log_dir)
    sys.modules["__main__"] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
