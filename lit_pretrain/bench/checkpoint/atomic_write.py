"""Case: atomic checkpoint writes (temporary file, sha256 on the way, fsync, rename, sidecar, folder fsync;
atomic.py, resume/verified.py) in MB/s over plain `torch.save` of the same checkpoint to the same folder,
alternated in one run.

The checkpoint is the experiment's GPT with AdamW state after one step (weights + two moments), the bytes a
training checkpoint holds. Plain torch.save returns before the bytes reach the disk (no fsync), so the ratio prices
durability and the checksum together. The detail gives the floor durability alone costs, torch.save followed by an
fsync of the file (no checksum, no rename), and the verified load time against a plain torch.load.

Every timed save starts with no dirty pages in the page cache (os.sync, untimed): otherwise each save pays for the
write-back of the one before it, and the side that follows an unsynced plain save pays the most. One untimed save
of each kind first (the hashing thread, the files' first allocation).
"""

import os
import tempfile
import time
from pathlib import Path

import torch

from lit_pretrain.bench import stats
from lit_pretrain.bench.step.step import paired_case
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.optimizers import build_adamw
from lit_pretrain.resume.verified import load_verified, save_atomic


def _checkpoint(c) -> dict:
    torch.manual_seed(c.run.seed)
    model = GPT(c.model)
    optimizer = build_adamw(model, c.optim)  # the groups and state a training checkpoint holds
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}


def _save_fsync(checkpoint: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())


def _mb_per_s(save, checkpoint: dict, path: Path) -> float:
    os.sync()  # the module docstring: no save pays for another's write-back
    start = time.perf_counter()
    save(checkpoint, path)
    seconds = time.perf_counter() - start
    return path.stat().st_size / 1e6 / seconds


def run(c, repeats: int) -> dict:
    checkpoint = _checkpoint(c)
    with tempfile.TemporaryDirectory(dir=".") as tmp:  # on the disk runs/ lives on, not a RAM-backed /tmp
        plain, atomic = Path(tmp) / "plain.ckpt", Path(tmp) / "atomic.ckpt"
        torch.save(checkpoint, plain)
        save_atomic(checkpoint, atomic)
        case = paired_case("checkpoint_atomic_save_mb_per_s", lambda: _mb_per_s(torch.save, checkpoint, plain),
                           lambda: _mb_per_s(save_atomic, checkpoint, atomic), repeats, ">= 0.8",
                           "MB/s", ("torch_save", "atomic"), {})
        case["detail"]["bytes"] = atomic.stat().st_size
        floor = [_mb_per_s(_save_fsync, checkpoint, Path(tmp) / "fsync.ckpt") for _ in range(repeats)]
        case["detail"].update(torch_save_fsync=floor,
                              torch_save_fsync_vs_torch_save=stats.median(floor) / case["reference"])
        start = time.perf_counter()
        # The reference: a plain weights-only load of the file this case has just written (what the project's
        # readers do after the checksum); the project itself opens checkpoints only through load_verified.
        torch.load(plain, map_location="cpu", weights_only=True)
        middle = time.perf_counter()
        load_verified(atomic)
        case["detail"].update(plain_load_s=middle - start, verified_load_s=time.perf_counter() - middle)
    return case
