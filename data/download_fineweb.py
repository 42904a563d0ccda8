#!/usr/bin/env python3
"""Downloads FineWeb10B GPT-2 shards (the validation shard and train shards 1..N) from the
Hugging Face dataset kjj0/fineweb10B-gpt2 into data/fineweb10B/.

Resumable: a download goes to <name>.part and continues from its size with an HTTP Range request;
the finished file's header is validated (magic, version, size = 1024 + 2 * token count) before it
is renamed into place. An existing valid shard is skipped; an invalid one is reported and fetched
again. Usage: python3 data/download_fineweb.py [N] [--dest DIR] [--base-url URL]
"""
import argparse
import http.client
import os
import struct
import sys
import urllib.error
import urllib.request

BASE_URL = "https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main"
MAX_TRAIN_SHARDS = 103  # the dataset's train shards: fineweb_train_000001.bin .. 000103, 100M tokens each
MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024
CHUNK = 1 << 20


class ShardError(Exception):
    pass


def validate_shard(path):
    """Returns the token count of a valid shard; raises ShardError naming the file and the problem."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: truncated header: {size} bytes, fewer than {HEADER_BYTES}")
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    if magic != MAGIC:
        raise ShardError(f"{path}: wrong magic {magic} (expected {MAGIC})")
    if version != VERSION:
        raise ShardError(f"{path}: unsupported version {version} (expected {VERSION})")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        raise ShardError(f"{path}: size {size} bytes does not match the header's token count {count} "
                         f"(expected {expected} bytes)")
    return count


def download(url, dest):
    """Fetches url into dest, resuming dest + '.part' if present. A .part that is the beginning of
    a shard (a dropped connection: urllib may end the body early without an error) is kept for
    the next run to resume; one that cannot be (wrong magic or version, too long) is removed."""
    part = dest + ".part"
    have = os.path.getsize(part) if os.path.exists(part) else 0
    try:
        append_from(url, part, have)
    except urllib.error.HTTPError as e:
        if e.code != 416:  # 416: the range starts at the end, so the .part already holds everything
            raise ShardError(f"{url}: HTTP {e.code} {e.reason}") from e
    except urllib.error.URLError as e:
        if not os.path.exists(part):  # nothing came: no server reached (offline, a wrong host)
            raise ShardError(f"{url}: cannot reach its server ({e.reason}): offline? --base-url names a mirror "
                             "that serves the same file names") from e
        raise ShardError(f"{url}: {e.reason}; rerun to resume {part}") from e
    except (ConnectionError, TimeoutError, http.client.HTTPException) as e:
        raise ShardError(f"{url}: {e!r} mid-transfer; rerun to resume {part}") from e
    try:
        validate_shard(part)
    except ShardError:
        missing = bytes_missing(part)
        if missing > 0:
            raise ShardError(f"{url}: the transfer ended {missing:,} bytes early; rerun to resume {part}")
        os.remove(part)  # resuming a corrupt .part would never succeed: the next run starts over
        raise
    os.replace(part, dest)


def bytes_missing(path):
    """How many bytes a shard that begins like path still lacks: positive for an intact beginning
    (header unread or valid, size below the header's), 0 or less when it cannot be completed."""
    size = os.path.getsize(path)
    if size < 12:
        return HEADER_BYTES - size
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("<3i", f.read(12))
    if magic != MAGIC or version != VERSION:
        return 0
    return max(HEADER_BYTES - size, HEADER_BYTES + 2 * count - size)


def append_from(url, part, have):
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(request) as response:
        if have and response.status != 206:  # the server ignored the range: start over
            have = 0
        with open(part, "ab" if have else "wb") as out:
            while chunk := response.read(CHUNK):
                out.write(chunk)


def shard_names(num_train):
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def fetch_all(num_train, dest_dir, base_url):
    if not 0 <= num_train <= MAX_TRAIN_SHARDS:
        raise ShardError(f"{num_train} train shards: the dataset has 0 to {MAX_TRAIN_SHARDS} (the record reads 7)")
    created = not os.path.isdir(dest_dir)
    os.makedirs(dest_dir, exist_ok=True)
    try:
        fetch_into(num_train, dest_dir, base_url)
    except BaseException:  # an interruption too
        if created and not os.listdir(dest_dir):  # a first download that got nothing leaves no empty folder
            os.rmdir(dest_dir)
        raise


def fetch_into(num_train, dest_dir, base_url):
    for name in shard_names(num_train):
        path = os.path.join(dest_dir, name)
        if os.path.exists(path):
            try:
                print(f"{path}: present, {validate_shard(path):,} tokens")
                continue
            except ShardError as e:
                print(f"{e}; downloading it again", file=sys.stderr)
                os.remove(path)
        download(f"{base_url}/{name}", path)
        print(f"{path}: downloaded, {validate_shard(path):,} tokens")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_train", nargs="?", type=int, default=8, help="train shards (the record reads 7)")
    parser.add_argument("--dest", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B"),
                        help="folder of the shards (default: data/fineweb10B, where run.sh looks)")
    parser.add_argument("--base-url", default=BASE_URL,
                        help="where the shards are: <base-url>/<shard name> (default: the Hugging Face dataset)")
    args = parser.parse_args(argv)
    try:
        fetch_all(args.num_train, args.dest, args.base_url)
    except (ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
