#!/usr/bin/env python3
"""The parameters of trainer checkpoints against a reference checkpoint, parameter by parameter: the
distributed oracle of SPEC 4.4 over real NCCL ranks (tools/acceptance.sh nccl runs the trainer at
W = 1 and at W = N on the same data; every rank of the W = N run holds every parameter).

For each parameter: the relative error ||candidate - reference|| / ||reference|| (as the GPU tests'
relative_error), 0 where the two are equal (both zero included), infinite where either holds a
value that is not finite or the reference is zero and the candidate is not; its worst over the candidates, and
the worst of all against --bound.

The checkpoint format (kernels/host/checkpoint_file.h, write_checkpoint): the magic SPDRCKP2, the step (u64), the
number of blobs (u64), then per blob its name's length (u64), the name, its size in bytes (u64), the
bytes, and a hash (u64), all little-endian. The parameters are in the blobs "embeddings" and
"masters"; the blob "parameter layout" says where, one "<name> <blob> <dtype> <offset> <count>"
line per parameter (dtype bf16 or fp32, offset and count in elements). The hashes are not
verified here (the trainer verifies them when it resumes); the optimizer states are not compared.

Usage:
    python3 tools/compare_checkpoints.py [--bound 0.1] REFERENCE CANDIDATE...
Prints one table row per parameter, then a last line
    worst relative error <x> (<parameter>, <candidate>), bound <b>: ok | FAILED
Exit status: 0 within the bound, 1 beyond it, 2 a file that is not a checkpoint or checkpoints
that do not match (another step or another parameter layout), 3 no numpy in this interpreter.
"""
import argparse
import math
import struct
import sys

try:
    import numpy as np
except ImportError:
    print(f"error: tools/compare_checkpoints.py needs numpy, which {sys.executable} lacks: install it with "
          "`apt-get install python3-numpy` (Debian, Ubuntu: for /usr/bin/python3) or `pip install numpy`",
          file=sys.stderr)
    sys.exit(3)

MAGIC = b"SPDRCKP2"
LAYOUT_BLOB = "parameter layout"
DTYPES = {"bf16": np.uint16, "fp32": np.float32}


class CheckpointError(Exception):
    pass


class Checkpoint:
    """A checkpoint's step and where each blob's bytes lie in the file (nothing else is read)."""

    def __init__(self, path):
        self.path = path
        self.blobs = {}  # name -> (file offset, size in bytes)
        with open(path, "rb") as f:
            def read(count, what):
                data = f.read(count)
                if len(data) != count:
                    raise CheckpointError(f"{path}: truncated checkpoint (while reading {what})")
                return data

            def read_u64(what):
                return struct.unpack("<Q", read(8, what))[0]

            if read(len(MAGIC), "the magic") != MAGIC:
                raise CheckpointError(f"{path}: not a checkpoint (bad magic)")
            self.step = read_u64("the step")
            for _ in range(read_u64("the blob count")):
                name = read(read_u64("a name length"), "a name").decode()
                size = read_u64("a blob size")
                self.blobs[name] = (f.tell(), size)
                f.seek(size, 1)
                read_u64(f"the hash of '{name}'")  # also catches a blob cut short by the end of the file
        self.layout = self._layout()

    def _blob_bytes(self, name):
        if name not in self.blobs:
            raise CheckpointError(f"{self.path}: no '{name}' blob"
                                  + (" (written before checkpoints named their parameters' places)"
                                     if name == LAYOUT_BLOB else ""))
        offset, size = self.blobs[name]
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def _layout(self):
        """name -> (blob, dtype, offset, count), in the file's order."""
        layout = {}
        for line in self._blob_bytes(LAYOUT_BLOB).decode().splitlines():
            fields = line.split()
            if len(fields) != 5 or fields[2] not in DTYPES:
                raise CheckpointError(f"{self.path}: bad parameter layout line '{line}'")
            name, blob, dtype, offset, count = fields
            layout[name] = (blob, dtype, int(offset), int(count))
        return layout

    def parameter(self, name):
        """The parameter's values as float64."""
        blob, dtype, offset, count = self.layout[name]
        if blob not in self.blobs:
            raise CheckpointError(f"{self.path}: no '{blob}' blob, which the layout names for {name}")
        start, size = self.blobs[blob]
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        if (offset + count) * itemsize > size:
            raise CheckpointError(f"{self.path}: {name} lies past the end of '{blob}'")
        values = np.fromfile(self.path, dtype=DTYPES[dtype], count=count, offset=start + offset * itemsize)
        if dtype == "bf16":  # the upper half of a float32
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float64)


def relative_error(candidate, reference):
    if np.array_equal(candidate, reference):
        return 0.0
    if not (np.all(np.isfinite(candidate)) and np.all(np.isfinite(reference))):
        return math.inf
    norm = math.sqrt(np.dot(reference, reference))
    difference = candidate - reference
    return math.sqrt(np.dot(difference, difference)) / norm if norm > 0 else math.inf


def compare(reference_path, candidate_paths):
    """Per parameter (in the reference's order): (worst relative error, the candidate it is in)."""
    reference = Checkpoint(reference_path)
    candidates = [Checkpoint(path) for path in candidate_paths]
    for c in candidates:
        if c.step != reference.step:
            raise CheckpointError(f"{c.path}: step {c.step}, the reference's is {reference.step}")
        if c.layout != reference.layout:
            raise CheckpointError(f"{c.path}: another parameter layout than {reference_path}")
    worst = {}
    for name in reference.layout:
        expected = reference.parameter(name)
        worst[name] = (0.0, candidate_paths[0])
        for c in candidates:
            error = relative_error(c.parameter(name), expected)
            if error > worst[name][0]:
                worst[name] = (error, c.path)
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", type=float, default=0.1, help="worst relative error allowed (default 0.1)")
    parser.add_argument("reference")
    parser.add_argument("candidates", nargs="+")
    args = parser.parse_args()
    try:
        worst = compare(args.reference, args.candidates)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| parameter | worst relative error | in |\n|---|---|---|")
    for name, (error, path) in worst.items():
        print(f"| {name} | {error:.3e} | {path} |")
    name, (error, path) = max(worst.items(), key=lambda item: item[1][0])
    within = error <= args.bound
    print(f"worst relative error {error:.3e} ({name}, {path}), bound {args.bound:g}: {'ok' if within else 'FAILED'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
