#!/usr/bin/env python3
"""data/download_fineweb.py: header validation, and a resumed download from a local HTTP server
(127.0.0.1, Range requests) that finishes a partial .part file."""
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

    def do_GET(self):
        body = self.files.get(self.path.rsplit("/", 1)[-1])
        if body is None:
            self.send_error(404)
            return
        start = 0
        if "Range" in self.headers:
            start = int(self.headers["Range"].split("=")[1].split("-")[0])
            self.ranges_seen.append(start)
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])

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

    def test_resumes_partial_download_and_skips_valid_shards(self):
        tokens = list(range(5000))
        files = {name: shard_bytes(tokens[: 100 + i]) for i, name in enumerate(dl.shard_names(2))}
        RangeHandler.files, RangeHandler.ranges_seen = files, []
        server = http.server.HTTPServer(("127.0.0.1", 0), RangeHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            base = f"http://127.0.0.1:{server.server_port}"
            val = dl.shard_names(2)[0]
            self.write(val + ".part", files[val][:600])  # an interrupted earlier download
            dl.fetch_all(2, self.dir.name, base)
            self.assertEqual(RangeHandler.ranges_seen, [600])
            for name, data in files.items():
                with open(os.path.join(self.dir.name, name), "rb") as f:
                    self.assertEqual(f.read(), data)
            dl.fetch_all(2, self.dir.name, base)  # everything present and valid: nothing fetched
            self.assertEqual(RangeHandler.ranges_seen, [600])
        finally:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    unittest.main()
