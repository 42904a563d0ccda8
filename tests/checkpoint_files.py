"""Trainer checkpoints written from Python, for the tests of tools/compare_checkpoints.py and
tools/acceptance.sh: the format and hash of write_checkpoint (kernels/host/checkpoint_file.h), byte for byte.

TINY_CHECKPOINT (tests/data/checkpoint/tiny.ckpt) is the file both sides are held to: test_trainer_host
reads it (so the hashes agree) and writes it back identically, test_compare_checkpoints writes it
again here and reads it with the tool. `python3 tests/checkpoint_files.py` rewrites it.
"""
import os
import struct

import numpy as np

MAGIC = b"SPDRCKP2"
MASK = (1 << 64) - 1
TINY_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint", "tiny.ckpt")


def checkpoint_hash(data):
    """checkpoint_hash (kernels/host/checkpoint_file.h): 8 bytes at a time, then the zero-padded tail."""
    h = 0x243F6A8885A308D3 ^ len(data)

    def mix(word):
        nonlocal h
        h = ((h ^ word) * 0x9E3779B97F4A7C15) & MASK
        h ^= h >> 29

    whole = len(data) // 8 * 8
    for (word,) in struct.iter_unpack("<Q", data[:whole]):
        mix(word)
    mix(int.from_bytes(data[whole:], "little"))
    return h


def write_checkpoint(path, step, blobs):
    """blobs: (name, bytes) in writing order."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QQ", step, len(blobs)))
        for name, data in blobs:
            f.write(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", len(data)) + data)
            f.write(struct.pack("<Q", checkpoint_hash(data)))


def bf16_bytes(values):
    """float32 values rounded to bf16 (to nearest even), as bytes."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def parameter_blobs(embeddings, masters, layout):
    """The blobs of a checkpoint with these parameters: layout lines as parameter_layout writes them;
    an optimizer state between, which the comparison must skip."""
    return [("embeddings", bf16_bytes(embeddings)), ("masters", np.asarray(masters, np.float32).tobytes()),
            ("adam m lm_head", bytes(range(12))), ("parameter layout", layout.encode())]


# The layout of three parameters: a 3 x 2 embedding, a 3 x 2 lm_head and 2 scalars behind it.
TINY_LAYOUT = "embed.weight embeddings bf16 0 6\nlm_head.weight masters fp32 0 6\nscalars masters fp32 6 2\n"
TINY_EMBEDDINGS = [1.0, -2.0, 0.5, 3.0, -0.25, 8.0]
TINY_MASTERS = [0.125, -1.5, 2.0, 0.0, 4.0, -0.75, 1.0, 0.5]
TINY_STEP = 4


def write_tiny_checkpoint(path):
    write_checkpoint(path, TINY_STEP, parameter_blobs(TINY_EMBEDDINGS, TINY_MASTERS, TINY_LAYOUT))


if __name__ == "__main__":
    write_tiny_checkpoint(TINY_CHECKPOINT)
    print(f"wrote {TINY_CHECKPOINT}")
