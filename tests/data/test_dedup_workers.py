"""Deduplication's worker processes: a worker that cannot start, raises, or dies twice on one chunk stops
the stage within seconds with one line; a worker killed once has its chunk retried; a script piped to Python runs.

Every test here has a deadline well under a minute (a signal alarm, or a subprocess timeout), so a pool that hangs
shows as a failure rather than a stuck suite. Faults come from the workers' test hook, LIT_PRETRAIN_WORKER_FAULT
(lit_pretrain/data/preparation/workers.py).
"""

import json
import random
import signal
import subprocess
import sys
import time

import pytest

from lit_pretrain import cli
from lit_pretrain.data.preparation import minhash
from lit_pretrain.data.preparation.corpus import Document
from lit_pretrain.data.preparation.deduplicate import deduplicate
from lit_pretrain.data.preparation.workers import FAULT_ENV
from lit_pretrain.errors import WorkerError
from lit_pretrain.schema import DeduplicationConfig
from tests.conftest import EXPERIMENTS, ROOT, tiny_data_overrides

pytestmark = pytest.mark.slow  # each test starts worker processes
CHUNK_CHARS = 30_000  # ~280 kB of planted documents in ~10 chunks
FIX = "data.deduplication.processes=1"


def near_copies(n_base: int = 100, n_copies: int = 40, seed: int = 0):
    """n_base documents of 300 random words, then n_copies of them with 1% of their words replaced (~280 kB);
    cheaper than tests/helpers/planted.py, which measures every pair's Jaccard by brute force."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(20_000)]
    texts = [[rng.choice(vocab) for _ in range(300)] for _ in range(n_base)]
    for words in rng.sample(texts, n_copies):
        copy = list(words)
        for i in rng.sample(range(len(copy)), 3):
            copy[i] = rng.choice(vocab)
        texts.append(copy)
    return [Document(id=f"doc{i:05d}", text=" ".join(words)) for i, words in enumerate(texts)]


@pytest.fixture(scope="module")
def corpus():
    docs = near_copies()
    undisturbed = deduplicate(docs, DeduplicationConfig(processes=1), progress=False)
    texts = [minhash.normalize(d.text, False, True) for d in docs]
    return docs, texts, undisturbed


@pytest.fixture(autouse=True)
def deadline(monkeypatch):
    """Fail, don't hang: 40 s for the test, and a worker silent for 20 s counts as gone."""
    def expire(*_):
        raise TimeoutError("the test ran past its 40 s deadline: a worker pool hangs")

    monkeypatch.setattr(minhash, "_CHUNK_CHARS", CHUNK_CHARS)
    monkeypatch.setattr(minhash, "_MIN_CHUNK_CHARS", CHUNK_CHARS)  # chunks of one size: the faults hit known ones
    monkeypatch.setattr(minhash, "_CHUNK_TIMEOUT_S", 20)
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(40)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def signatures(texts, processes):
    return minhash.compute_signatures(texts, "word", 5, 128, 1, processes=processes, progress=False,
                                      ids=[f"doc{i:05d}" for i in range(len(texts))])


def test_a_worker_killed_mid_chunk_is_replaced_and_its_chunk_retried_once(corpus, monkeypatch, tmp_path, capsys):
    docs, texts, undisturbed = corpus
    monkeypatch.setenv(FAULT_ENV, f"kill-once:{tmp_path / 'fired'}")
    result = deduplicate(docs, DeduplicationConfig(processes=2), progress=False)
    assert (tmp_path / "fired").exists()  # a worker did kill itself
    notes = [line for line in capsys.readouterr().err.splitlines() if "retrying" in line]
    assert len(notes) == 1, notes
    assert "was killed by SIGKILL during the chunk from document 'doc00000'" in notes[0]
    assert notes[0].endswith("retrying that chunk once on a new worker")
    assert result.report["near"]["processes"] == 2
    assert undisturbed.report["near"]["removed_documents"] == 40
    assert [d.id for d in result.kept] == [d.id for d in undisturbed.kept]


def test_a_second_death_on_the_same_chunk_stops_the_stage_with_one_line(corpus, monkeypatch):
    _, texts, _ = corpus
    monkeypatch.setenv(FAULT_ENV, "kill")  # every worker dies on its first chunk
    with pytest.raises(WorkerError) as err:
        signatures(texts, 2)
    message = str(err.value)
    assert "\n" not in message
    assert "was killed by SIGKILL during the chunk from document 'doc00000'" in message
    assert "already been retried" in message and "killed from outside (out of memory?)" in message
    assert message.endswith(minhash._FIX) and FIX in message


def test_a_worker_that_raises_at_import_fails_clearly_within_10_s(corpus, monkeypatch):
    _, texts, _ = corpus
    monkeypatch.setenv(FAULT_ENV, "import")
    start = time.perf_counter()
    with pytest.raises(WorkerError) as err:
        signatures(texts, 2)
    assert time.perf_counter() - start < 10
    message = str(err.value)
    assert "\n" not in message
    # What failed, the chunk's first document, the worker's own last error line, and the fix.
    assert "MinHash signature worker (pid " in message and "exited with code 1 while starting" in message
    assert "(its first chunk starts at document 'doc00000')" in message
    assert f"RuntimeError: {FAULT_ENV}=import: a test fault raised while the worker starts" in message
    assert FIX in message


def test_a_chunk_that_raises_in_a_worker_names_its_document_and_error(corpus):
    _, texts, _ = corpus
    # Two chunks, both sent to the one worker: its error comes back, not this process's.
    with pytest.raises(WorkerError, match=r"failed on the chunk from document 'doc00000': ValueError: shingle kind "
                                          r"'sentence' is not 'word' or 'char': set data.deduplication.processes=1"):
        minhash.compute_signatures(texts[:20], "sentence", 5, 128, 1, processes=2, progress=False,
                                   ids=[f"doc{i:05d}" for i in range(20)])


def test_the_cli_exits_2_with_one_line_when_workers_cannot_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "import")
    rc = cli.main(["prepare", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(tmp_path / "prepared"),
                   "data.max_documents=100", "data.deduplication.processes=2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("lit-pretrain prepare: error: MinHash signature worker"), lines
    assert "RuntimeError" in lines[0] and FIX in lines[0]


# A main module a spawned process cannot re-import: multiprocessing's workers died at start for ever.
PIPED_SCRIPT = f"""
import json, sys
from lit_pretrain.data.preparation import minhash
from lit_pretrain.data.preparation.corpus import Document
from lit_pretrain.data.preparation.deduplicate import deduplicate
from lit_pretrain.schema import DeduplicationConfig

minhash._CHUNK_CHARS = {CHUNK_CHARS}
docs = [Document(**d) for d in json.load(open(sys.argv[1]))]
result = deduplicate(docs, DeduplicationConfig(processes=2), progress=False)
print(json.dumps([result.report["near"]["processes"], [d.id for d in result.kept]]))
"""


def test_a_script_piped_to_python_uses_its_workers_and_never_hangs(corpus, tmp_path):
    docs, _, undisturbed = corpus
    (tmp_path / "docs.json").write_text(json.dumps([{"id": d.id, "text": d.text} for d in docs]))
    out = subprocess.run([sys.executable, "-", str(tmp_path / "docs.json")], input=PIPED_SCRIPT,
                         capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [2, [d.id for d in undisturbed.kept]]
    assert out.stderr == ""
