#!/usr/bin/env python3
"""data/download_fineweb.py: header validation, and resumed downloads from a local HTTP server
(127.0.0.1, Range requests): a partial .part finished, a dropped connection kept for the next run,
a missing file named by its URL."""
import http.server
import os
import struct
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data"))
import download_fineweb as dl  # noqa: E402


def shard_bytes(tokens, magic=dl.MAGIC, version=dl.VERSION, count=None):
    header = [0] * 256
    header[:3] = [magic, version, len(tokens) if count is None else count]
    return struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens)


class RangeHandler(http.server.BaseHTTPRequestHandler):
    files = {}
    ranges_seen = []
    cut_after = None  # the next response stops after this many body bytes, then the connection drops

    def do_GET(self):
        body = self.files.get(self.path.rsplit("/", 1)[-1])
        if body is None:
            self.send_error(404)
            return
        start = 0
        if "Range" in self.headers:
            start = int(self.headers["Range"].split("=")[1].split("-")[0])
            self.ranges_seen.append(start)
        if start >= len(body):
            self.send_error(416)
            return
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        end = len(body) if RangeHandler.cut_after is None else start + RangeHandler.cut_after
        RangeHandler.cut_after = None
        self.wfile.write(body[start:end])

    def log_message(self, *args):
        pass


class DownloadTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, data):
        path = os.path.join(self.dir.name, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_validation_accepts_good_and_names_each_problem(self):
        self.assertEqual(dl.validate_shard(self.write("good.bin", shard_bytes([1, 2, 3]))), 3)
        cases = {
            "magic.bin": (shard_bytes([1], magic=7), "wrong magic 7"),
            "version.bin": (shard_bytes([1], version=2), "unsupported version 2"),
            "size.bin": (shard_bytes([1, 2], count=5), "does not match the header's token count 5"),
            "short.bin": (b"abc", "truncated header"),
        }
        for name, (data, message) in cases.items():
            with self.assertRaises(dl.ShardError) as e:
                dl.validate_shard(self.write(name, data))
            self.assertIn(name, str(e.exception))
            self.assertIn(message, str(e.exception))

    def serve(self, files):
        RangeHandler.files, RangeHandler.ranges_seen, RangeHandler.cut_after = files, [], None
        server = http.server.HTTPServer(("127.0.0.1", 0), RangeHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return f"http://127.0.0.1:{server.server_port}"

    def assert_downloaded(self, files):
        for name, data in files.items():
            with open(os.path.join(self.dir.name, name), "rb") as f:
                self.assertEqual(f.read(), data)
            self.assertFalse(os.path.exists(os.path.join(self.dir.name, name + ".part")))

    def test_resumes_partial_download_and_skips_valid_shards(self):
        tokens = list(range(5000))
        files = {name: shard_bytes(tokens[: 100 + i]) for i, name in enumerate(dl.shard_names(2))}
        base = self.serve(files)
        val = dl.shard_names(2)[0]
        self.write(val + ".part", files[val][:600])  # an interrupted earlier download
        dl.fetch_all(2, self.dir.name, base)
        self.assertEqual(RangeHandler.ranges_seen, [600])
        self.assert_downloaded(files)
        dl.fetch_all(2, self.dir.name, base)  # everything present and valid: nothing fetched
        self.assertEqual(RangeHandler.ranges_seen, [600])

    def test_complete_part_is_finished_and_bad_shard_fetched_again(self):
        files = {name: shard_bytes(list(range(50))) for name in dl.shard_names(1)}
        base = self.serve(files)
        val, train = dl.shard_names(1)
        self.write(val + ".part", files[val])  # interrupted after the last byte, before the rename
        self.write(train, shard_bytes([1, 2], count=9))  # a corrupt finished shard
        dl.fetch_all(1, self.dir.name, base)
        self.assertEqual(RangeHandler.ranges_seen, [len(files[val])])
        self.assert_downloaded(files)

    def test_corrupt_part_is_removed_so_the_next_run_starts_over(self):
        val = dl.shard_names(0)[0]
        base = self.serve({val: shard_bytes([1, 2, 3])})
        self.write(val + ".part", shard_bytes([1], magic=5)[:700])  # not a prefix of the real file
        with self.assertRaises(dl.ShardError):
            dl.fetch_all(0, self.dir.name, base)
        self.assertFalse(os.path.exists(os.path.join(self.dir.name, val + ".part")))
        dl.fetch_all(0, self.dir.name, base)
        self.assert_downloaded({val: shard_bytes([1, 2, 3])})

    def test_dropped_connection_keeps_the_part_for_the_next_run(self):
        val = dl.shard_names(0)[0]
        data = shard_bytes(list(range(3000)))
        base = self.serve({val: data})
        RangeHandler.cut_after = 2500
        with self.assertRaises(dl.ShardError) as e:
            dl.fetch_all(0, self.dir.name, base)
        self.assertIn("rerun to resume", str(e.exception))
        self.assertEqual(os.path.getsize(os.path.join(self.dir.name, val + ".part")), 2500)
        dl.fetch_all(0, self.dir.name, base)
        self.assertEqual(RangeHandler.ranges_seen, [2500])
        self.assert_downloaded({val: data})

    def test_missing_file_is_named_by_its_url(self):
        base = self.serve({})
        with self.assertRaises(dl.ShardError) as e:
            dl.fetch_all(0, self.dir.name, base)
        self.assertIn(f"{base}/{dl.shard_names(0)[0]}: HTTP 404", str(e.exception))

    def test_no_server_is_named_without_a_resume_and_leaves_no_folder(self):
        import socket
        with socket.socket() as closed:  # a port nothing listens on: the connection is refused
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        dest = os.path.join(self.dir.name, "new")
        with self.assertRaises(dl.ShardError) as e:
            dl.fetch_all(1, dest, f"http://127.0.0.1:{port}")
        self.assertIn(f"http://127.0.0.1:{port}/{dl.shard_names(0)[0]}: cannot reach its server (", str(e.exception))
        self.assertIn("offline? --base-url names a mirror", str(e.exception))
        self.assertNotIn("resume", str(e.exception))
        self.assertFalse(os.path.exists(dest))

    def test_refuses_a_shard_count_the_dataset_does_not_have(self):
        for n in (-1, dl.MAX_TRAIN_SHARDS + 1):
            with self.assertRaises(dl.ShardError) as e:
                dl.fetch_all(n, os.path.join(self.dir.name, "x"), "http://127.0.0.1:9")
            self.assertIn(f"{n} train shards: the dataset has 0 to 103", str(e.exception))
        self.assertFalse(os.path.exists(os.path.join(self.dir.name, "x")))


if __name__ == "__main__":
    unittest.main()
