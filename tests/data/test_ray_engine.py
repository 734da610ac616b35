"""data.engine=ray: the same prepared folder as the local engine, byte for byte, for 1 and 2 Ray workers, with a
worker killed mid-stage; bad input as one line. One local Ray session (2 CPUs) serves the module.

The numpy banding the Ray reducers use is checked against datasketch's MinHashLSH without Ray."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from lit_pretrain.data.preparation import lsh
from lit_pretrain.data.preparation.lsh import band_pairs, bands_rows, candidate_pairs, index_basename, minhashlsh_pairs
from lit_pretrain.data.preparation.minhash import compute_signatures, normalize
from lit_pretrain.errors import DataError
from lit_pretrain.schema import DataConfig, DeduplicationConfig
from tests.conftest import free_port, run_module
from tests.helpers.planted import planted_corpus

# A test on the Ray session is multi-process (a local cluster: GCS, raylet, 2 workers; ~12 s of the session's start,
# its tasks and its teardown), so it is slow like every other multi-process test and leaves `make test-fast`.
ON_RAY = pytest.mark.slow
NO_RAY = "ray is not installed (pip install 'lit-pretrain[ray]'; CI installs it with the dev extra)"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The planted corpus (300 originals, their edited copies, 60 singles) plus exact copies, whitespace variants
    and empty lines, over 5 jsonl files of uneven sizes."""
    docs, pairs = planted_corpus(n_pairs=300, n_singles=60, seed=3, words=120)
    texts = [d.text for d in docs]
    texts[50:50] = [texts[10], "   ", "  " + texts[20].replace(" ", "   ") + "\n", ""]
    texts += [texts[5], texts[7]]
    folder = tmp_path_factory.mktemp("ray-corpus")
    cuts = [0, 40, 200, 230, 500, len(texts)]
    for k in range(5):
        with open(folder / f"part-{k}.jsonl", "w") as f:
            for text in texts[cuts[k] : cuts[k + 1]]:
                f.write(json.dumps({"text": text}) + "\n")
    return folder, pairs


def data_config(corpus_folder: Path, out: Path, **kw) -> DataConfig:
    return DataConfig(corpus="jsonl", paths=[str(corpus_folder)], prepared_dir=str(out), vocab_size=300,
                      val_fraction=0.1, shard_tokens=4096, deduplication=DeduplicationConfig(processes=1), **kw)


def folder_bytes(folder: Path) -> dict:
    """Every file of a prepared folder; in the two reports, what does not depend on the engine (not its seconds,
    the engine and its workers)."""
    out = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    manifest = json.loads(out.pop("manifest.json"))
    manifest.pop("seconds")
    report = json.loads(out.pop("deduplication.json"))
    for key in ("seconds", "engine"):
        report.pop(key)
    for key in ("processes", "index"):
        report["near"].pop(key)
    return {**out, "manifest": manifest, "report": report}


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    ray = pytest.importorskip("ray", reason=NO_RAY)
    from lit_pretrain.data.preparation import ray_engine

    hooks = tmp_path_factory.mktemp("ray-hooks")
    os.environ[ray_engine.KILL_HOOK] = str(hooks)  # before ray.init: the workers inherit it
    ray_engine.init_local(ray, 2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield hooks
    finally:
        ray.shutdown()
        os.environ.pop(ray_engine.KILL_HOOK)


@pytest.fixture(scope="module")
def local_folder(corpus, tmp_path_factory):
    from lit_pretrain.data.preparation.prepare import prepare

    out = tmp_path_factory.mktemp("local") / "prepared"
    manifest = prepare(data_config(corpus[0], out), log=lambda *_: None)
    dedup = manifest["deduplication"]
    # The corpus exercises every kind of removal, so equality below is not about an empty set.
    assert manifest["corpus"]["dropped_empty"] == 2 and dedup["removed_exact"] >= 4 and dedup["removed_near"] >= 100
    return folder_bytes(out)


@pytest.fixture
def small_groups(monkeypatch):
    # One file a task: 5 read tasks and 5 tokenize tasks, so 2 workers really interleave.
    from lit_pretrain.data.preparation import ray_engine

    monkeypatch.setattr(ray_engine, "GROUP_BYTES", 1)


@ON_RAY
@pytest.mark.parametrize("workers, one_file_a_task", [(1, True), (2, False)])
def test_ray_engine_writes_the_local_engines_folder(corpus, local_folder, ray_session, monkeypatch, tmp_path,
                                                    workers, one_file_a_task):
    from lit_pretrain.data.preparation import ray_engine
    from lit_pretrain.data.preparation.prepare import prepare

    if one_file_a_task:  # 5 read and 5 tokenize tasks; else the corpus's ~0.5 MB is cut into groups of ~60 kB
        monkeypatch.setattr(ray_engine, "GROUP_BYTES", 1)

    lines = []
    prepare(data_config(corpus[0], tmp_path / "ray", engine="ray", workers=workers), log=lines.append)
    assert folder_bytes(tmp_path / "ray") == local_folder
    report = json.loads((tmp_path / "ray" / "deduplication.json").read_text())
    assert report["engine"] == {"name": "ray", "workers": workers, "ray_address": None}
    assert report["near"]["index"] == {"storage": "ray", "reducers": workers, "components": "union-find on the driver"}
    assert {"read_signatures", "lsh", "clusters", "tokenize"} <= set(report["seconds"])
    assert any(line.startswith("ray lsh: ") and "documents/s" in line for line in lines)


@ON_RAY
def test_a_killed_worker_is_replaced_and_the_output_is_unchanged(corpus, local_folder, ray_session, small_groups,
                                                                 tmp_path):
    from lit_pretrain.data.preparation.prepare import prepare

    trigger = ray_session / "kill-read"
    trigger.touch()
    prepare(data_config(corpus[0], tmp_path / "ray", engine="ray", workers=2), log=lambda *_: None)
    assert not trigger.exists()  # a read task took it and ended its worker with os._exit
    assert folder_bytes(tmp_path / "ray") == local_folder


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=ON_RAY)])
def test_a_file_the_workers_cannot_read_is_one_line_naming_it(corpus, request, tmp_path, engine):
    from lit_pretrain.data.preparation.prepare import prepare

    unreadable = "/proc/self/mem"  # opens, then every read from offset 0 fails with EIO, even for root
    if not os.path.exists(unreadable):
        pytest.skip("needs Linux's /proc/self/mem")
    if engine == "ray":
        request.getfixturevalue("ray_session")
    cfg = data_config(corpus[0], tmp_path / "out" / "prepared", engine=engine)
    cfg.paths = [str(corpus[0] / "part-0.jsonl"), unreadable]
    with pytest.raises(DataError, match=r"^cannot read /proc/self/mem \(.*\): check that every machine"):
        prepare(cfg, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@ON_RAY
def test_invalid_utf8_and_a_corpus_cut_mid_file_are_counted_alike(ray_session, tmp_path):
    """The counters the workers report per document (bytes that are not UTF-8, control characters, empty lines)
    add up to the local engine's, and data.max_documents cuts the corpus at the same document inside a file."""
    from lit_pretrain.data.preparation.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(7)
    words = [f"w{i}" for i in range(500)]
    for k in range(3):
        lines = [json.dumps({"text": " ".join(rng.choice(words, 40))}).encode() for _ in range(40)]
        lines[5] = b'{"text": "caf\xe9 \xff\xfe au lait\u0007 ' + b"x" * 60 + b'"}'  # 3 invalid bytes, 1 control
        lines[9] = b'{"text": "  "}'
        (corpus / f"part-{k}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    manifests = {}
    for engine in ("local", "ray"):
        cfg = data_config(corpus, tmp_path / engine, engine=engine, workers=2, max_documents=95,
                          max_invalid_fraction=1.0)
        manifests[engine] = prepare(cfg, log=lambda *_: None)
        manifests[engine].pop("seconds")
    assert manifests["local"]["corpus"]["invalid_utf8_sequences"] == 9
    assert manifests["local"]["corpus"]["documents"] == 95 and manifests["local"]["corpus"]["dropped_empty"] == 3
    assert manifests["ray"] == manifests["local"]
    assert (tmp_path / "ray" / "removed.jsonl").read_bytes() == (tmp_path / "local" / "removed.jsonl").read_bytes()


@pytest.mark.slow
def test_an_unreachable_ray_address_is_exit_2_and_one_line(corpus, tmp_path):
    pytest.importorskip("ray", reason=NO_RAY)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = run_module("lit_pretrain.cli", "prepare", "experiments/runs/tiny.yaml", "data.engine=ray",
                     f"data.ray_address={address}", f"data.prepared_dir={tmp_path / 'out' / 'p'}", rc=2, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"data.ray_address='{address}'" in lines[0] and "ray start --head" in lines[0]
    assert not (tmp_path / "out").exists()


def test_numpy_banding_gives_minhashlsh_candidate_pairs(corpus, monkeypatch):
    """lsh.band_pairs (storage=memory's candidate pairs, and the Ray reducers' grouping) against datasketch's
    MinHashLSH insert-all-then-query, on the planted corpus at the default bands x rows, on generated short
    documents of a small vocabulary (many shared buckets, some of many documents) and on signatures of few distinct
    values (large shared buckets); again with every row hashed alike (bands sorted by lexsort after the collision)."""
    docs, _ = planted_corpus(n_pairs=120, n_singles=30, seed=5, words=120)
    cfg = DeduplicationConfig(processes=1)
    sig, _ = compute_signatures([normalize(d.text, False, True) for d in docs], "word", 5, 128, 1, 1, progress=False)
    rng = np.random.default_rng(0)
    vocab = np.array([f"w{i}" for i in range(12)])
    short = [" ".join(rng.choice(vocab, rng.integers(1, 9))) for _ in range(400)]
    short_sig, _ = compute_signatures(short, "word", 2, 128, 1, 1, progress=False)
    generated = rng.integers(0, 3, size=(200, 128)).astype(sig.dtype)
    for signatures, (bands, rows) in ((sig, bands_rows(cfg)), (short_sig, bands_rows(cfg)), (generated, (20, 2)),
                                      (generated, (9, 3))):
        want_left, want_right = minhashlsh_pairs(signatures, bands, rows, cfg.seed)
        left, right = band_pairs(signatures, bands, rows)
        memory_left, memory_right, index = candidate_pairs(signatures, cfg, bands, rows, index_basename(cfg))
        assert len(want_left) > 20 and index == {"storage": "memory"}
        for got in (left, memory_left):
            np.testing.assert_array_equal(got, want_left)
        for got in (right, memory_right):
            np.testing.assert_array_equal(got, want_right)
        with monkeypatch.context() as m:
            m.setattr(lsh, "_row_hashes", lambda keys: np.zeros(len(keys), dtype=np.uint64))
            collided = band_pairs(signatures, bands, rows)
        np.testing.assert_array_equal(collided[0], want_left)
        np.testing.assert_array_equal(collided[1], want_right)


def _listening(pids) -> list:
    """(address, port) of every TCP socket in LISTEN state owned by one of `pids` (from /proc: no ss needed)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # a process that ended meanwhile
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


@ON_RAY
def test_the_local_cluster_listens_on_loopback_only(ray_session):
    import ray

    # Every process of the session: Ray's servers are children of this process (GCS, raylet, workers).
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    ours = [p for p in pids if _ancestor(p, os.getpid())]
    sockets = _listening(ours)
    assert len(sockets) >= 3, sockets  # the GCS, the raylet and the object manager at least
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1 in tcp and as IPv4-mapped in tcp6
    assert all(address in loopback for address, _ in sockets), sockets
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}


def _ancestor(pid: int, root: int) -> bool:
    """Whether `root` is `pid`'s ancestor (or `pid` itself)."""
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False
