"""tools/corpus_run.sh's runs of the recipe without a GPU: `full` (the trainer of build/) and
`record` (a committed record's frozen build, staged by `stage-record`, run in the record's folder),
each run's log packed into $OUT after every run (the device tool brings back 8 files at most), a
run that stops not losing the others, and the statistics of the runs. The script runs in a copy of
the repository's layout: the corpus staged as `stage` leaves it, the trainers stand-ins that check
where they run and write a log with a final validation line; the real tools/records.py."""
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECORD = "records/2026-01-02_fake"

# A trainer: refuses to run outside a folder with train_gpt.cu when FAKE_NEEDS_SOURCE is set (a
# record's build of 2026-11-26 logs that file), checks that the corpus glob matches, and writes a
# log whose final val loss counts the runs; FAKE_STOP=K makes run K stop with exit 3, no log.
TRAINER = """\
    import glob, os, sys, uuid
    args = sys.argv[1:]
    flag = lambda name: args[args.index(name) + 1]
    if os.environ.get("FAKE_NEEDS_SOURCE") and not os.path.exists("train_gpt.cu"):
        sys.exit("not run in the record's folder: " + os.getcwd())
    if not glob.glob(flag("--train-files")):
        sys.exit("no shard matches " + flag("--train-files"))
    count = os.path.join(os.environ["FAKE_STATE"], "runs")
    n = int(open(count).read()) + 1 if os.path.exists(count) else 1
    open(count, "w").write(str(n))
    if os.environ.get("FAKE_STOP") == str(n):
        sys.exit(3)
    N = int(flag("--num-iterations"))
    with open(os.path.join(flag("--log-dir"), str(uuid.uuid4()) + ".txt"), "w") as log:
        log.write("step:%d/%d val_loss:%.4f train_time:80000ms step_avg:93.02ms\\n" % (N, N, 2.660 + 0.001 * n))
    """


class CorpusRunTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root)
        self.repo = os.path.join(self.root, "repo")
        for tool in ("corpus_run.sh", "records.py", "stage_build.sh", "build_frozen.sh"):
            os.makedirs(os.path.join(self.repo, "tools"), exist_ok=True)
            shutil.copy(os.path.join(ROOT, "tools", tool), os.path.join(self.repo, "tools", tool))
        corpus = os.path.join(self.repo, ".carry", "corpus")
        os.makedirs(corpus)
        shard = os.path.join(corpus, "corpus_train_000001.bin")
        with open(shard, "wb") as f:
            f.write(b"tokens")
        subprocess.run(["xz", shard], check=True)
        digest = subprocess.run(["sha256sum", "--"], input=b"tokens", capture_output=True, check=True).stdout
        with open(os.path.join(corpus, "SHA256SUMS"), "w") as f:
            f.write(digest.decode().split()[0] + "  corpus_train_000001.bin\n")
        for path in ("build/train_gpt", f".carry/{os.path.basename(RECORD)}/train_gpt"):
            self.write(path, f"#!{sys.executable}\n" + textwrap.dedent(TRAINER), executable=True)
        self.write(f"{RECORD}/train_gpt.cu", "// the record's frozen file\n")
        self.out = os.path.join(self.root, "out")
        os.makedirs(self.out)
        self.state = os.path.join(self.root, "state")
        os.makedirs(self.state)

    def write(self, path, text, executable=False):
        full = os.path.join(self.repo, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
        if executable:
            os.chmod(full, 0o755)

    def corpus_run(self, *args, **env):
        environment = dict(os.environ, OUT=self.out, FAKE_STATE=self.state, SPEEDRUN_PREBUILT="1", **env)
        return subprocess.run(["bash", os.path.join(self.repo, "tools", "corpus_run.sh"), *args], env=environment,
                              capture_output=True, text=True, timeout=120)

    def packed(self, name):
        with tarfile.open(os.path.join(self.out, name)) as tar:
            return sorted(tar.getnames())

    def test_full_packs_every_run_s_log_into_one_file_back(self):
        result = self.corpus_run("full", "3")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(os.listdir(self.out), ["corpus-logs.tar.gz"])
        logs = self.packed("corpus-logs.tar.gz")
        self.assertEqual(len(logs), 3)
        self.assertTrue(all(name.startswith("logs/") for name in logs), logs)
        self.assertIn("| 3 | 860 | 2.66200 |", result.stdout)  # records.py stats of the three

    def test_a_run_that_stops_loses_none_of_the_others(self):
        result = self.corpus_run("full", "3", FAKE_STOP="2")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("run 2 of 3: the trainer stopped with exit 3", result.stderr)
        self.assertEqual(len(self.packed("corpus-logs.tar.gz")), 2)

    def test_a_record_runs_its_staged_build_in_its_folder(self):
        result = self.corpus_run("record", RECORD, "2", FAKE_NEEDS_SOURCE="1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(self.packed("record-logs.tar.gz")), 2)
        self.assertIn("| 2 | 860 | 2.66150 |", result.stdout)
        os.remove(os.path.join(self.repo, ".carry", os.path.basename(RECORD), "train_gpt"))
        result = self.corpus_run("record", RECORD)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"train_gpt is missing: tools/corpus_run.sh stage-record {RECORD}, here", result.stderr)

    def test_stage_record_refuses_what_is_no_record(self):
        result = self.corpus_run("stage-record", "records/nothing")
        self.assertEqual(result.returncode, 2)
        self.assertIn("records/nothing/train_gpt.cu: no such record", result.stderr)
        result = self.corpus_run("stage-record", RECORD)  # line 3 of its file is no nvcc command
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("line 3 is not its build command", result.stderr)


if __name__ == "__main__":
    unittest.main()
