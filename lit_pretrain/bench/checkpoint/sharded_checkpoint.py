"""Cases: sharded against one-file checkpoints of a 2-process ZeRO-3 run of the experiment's model (resume/sharded/).

Two spawned processes (gloo) hold the GPT under FSDP2 with AdamW state after one step; one spawn per format:
- one file: the state gathered onto rank 0 (ParallelModel.full_state / full_optimizer_state, what the one-file
  format does under every sharded strategy) and written there atomically with its sidecar;
- sharded: every rank writes its own shard (DCP), hashes it, rank 0 writes the manifest;
- async: the stall only, i.e. what training waits for: the copy of each rank's shard and the hand-off to the
  background writer (the write itself is then waited for, outside the timing).
Rank 0's peak resident memory above its level before each save (VmHWM, reset through /proc/self/clear_refs), the
save wall times, and the load time of each format back into the same layout. Times: medians and spreads of the
repeats (bench/stats.py); the peak: the first save's (a high-water mark, not timed).
"""

import concurrent.futures
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lit_pretrain.bench import stats


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _peak_during(fn) -> tuple:
    """(seconds, peak resident bytes above the level before) of fn() on this process (Linux; 0 bytes elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, max(0, _status_kb("VmHWM") - before) * 1024


def _worker(rank: int, world: int, port: int, mode: str, model_cfg, optim_cfg, folder: str, repeats: int,
            results) -> None:
    """One format per spawn (`mode`: single or sharded), so that rank 0's first save of it, the one whose peak is
    measured, runs in a process no earlier save has grown (glibc keeps freed memory for reuse)."""
    import torch.distributed as dist

    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_adamw
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.mesh import build_mesh
    from lit_pretrain.planning.plan import ParallelPlan
    from lit_pretrain.resume.sharded import save as sharded
    from lit_pretrain.resume.verified import load_verified, save_atomic

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    plan = ParallelPlan(data_parallel_shard=world, zero_stage=3)
    torch.manual_seed(0)
    model = GPT(model_cfg)
    par = apply_plan(model, plan, build_mesh(plan))
    opt = build_adamw(model, optim_cfg, kernel="foreach")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    root = Path(folder)
    single_file = root / "single.ckpt"

    def save_single(n: int):
        weights, state = par.full_state(), par.full_optimizer_state(opt)
        if rank == 0:
            save_atomic({"state_dict": weights, "optimizer_states": [state]}, single_file)
        dist.barrier()

    def start_sharded(n: int, staged: bool = False):
        """What training waits for: the chunks (copied when staged), the folder, the small files."""
        folder = root / f"step{n:07d}"
        chunks = {**sharded.model_chunks(model, par), **sharded.optimizer_chunks(model, opt, par)}
        if staged:
            chunks = {k: sharded.Chunk(c.local.clone(), c.size(), c.offsets) for k, c in chunks.items()}
        group = sharded.checkpoint_group()
        sharded._prepare_folder(folder, rank, group)
        written = sharded._save_torch({} if rank == 0 else None, folder, rank)
        return folder, chunks, group, {"step": n, "meta": {}, "layout": {}, "world_size": world}, None, written

    def save_sharded(n: int):
        sharded._save_files(*start_sharded(n))

    # Warm-up outside the figures, in both spawns alike: a save of one number in each format (imports, the
    # checkpoint group, first-call set-up: once per run in training too).
    warm = root / "step0000000"
    sharded._prepare_folder(warm, rank, sharded.checkpoint_group())
    sharded._save_torch({} if rank == 0 else None, warm, rank)
    sharded._save_files(warm, {"x": sharded.Chunk(torch.ones(()), (), ())}, sharded.checkpoint_group(),
                        {"step": 0, "meta": {}, "layout": {}, "world_size": world}, None)
    if rank == 0:
        save_atomic({"x": torch.ones(())}, root / "warm.ckpt")

    save = save_single if mode == "single" else save_sharded
    out = {"s": [], "load_s": [], "stall_s": []}
    out["peak"] = _peak_during(lambda: save(1))[1]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    for n in range(2, repeats + 2):
        out["s"].append(_peak_during(lambda n=n: save(n))[0])
        if mode == "sharded":
            start = time.perf_counter()
            job = start_sharded(100 + n, staged=True)
            future = pool.submit(sharded._save_files, *job)
            out["stall_s"].append(time.perf_counter() - start)
            future.result()
        start = time.perf_counter()
        if mode == "single":
            box = [load_verified(single_file) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # rank 0 reads the file, every rank takes its share
            par.load_full_state(box[0]["state_dict"])
            par.load_full_optimizer_state(opt, box[0]["optimizer_states"][0])
            del box
        else:
            storage = sharded.reader(root / f"step{n:07d}")
            sharded.load_model(storage, model, par)
            sharded.load_optimizer(storage, model, par, opt, {})
        dist.barrier()
        out["load_s"].append(time.perf_counter() - start)
    dist.destroy_process_group()
    if rank == 0:
        results[mode] = out


def run(c, repeats: int, world: int = 2) -> list:
    """Three cases (rank 0's peak memory, save time, training stall) and the load times in their detail."""
    from lit_pretrain.bench.parallel.compositions import _free_port

    r = {}
    for mode in ("single", "sharded"):
        with tempfile.TemporaryDirectory(dir=".") as tmp, mp.get_context("spawn").Manager() as manager:
            results = manager.dict()
            mp.start_processes(_worker, args=(world, _free_port(), mode, c.model, c.optim, tmp, repeats, results),
                               nprocs=world, join=True, start_method="spawn")
            r[mode] = dict(results)[mode]
    return cases(r["single"], r["sharded"], world, repeats)


def cases(single: dict, shard: dict, world: int, repeats: int) -> list:
    """The cases from each launch's figures (`_worker`'s dict per format)."""
    # One launch per format (spawning costs more than a save): pair i is save (load) i of each launch.
    load = stats.summary(single["load_s"], shard["load_s"])
    detail = {"processes": world, "layout": "zero_stage=3", "repeats": repeats, "pairs": "save i of each launch",
              "single_load_s": load["reference"], "sharded_load_s": load["value"], "load_ratio": load["ratio"]}
    if "spread" in load:  # one repeat has no spread (bench/stats.py): the field is left out, as in every case
        detail["load_ratio_spread"] = load["spread"]
    return [
        {"case": "checkpoint_sharded_rank0_peak_bytes", "value": shard["peak"], "reference": single["peak"],
         "ratio": shard["peak"] / single["peak"] if single["peak"] else float("nan"),
         "goal": f"report (~1/{world} or less)", "unit": "bytes", "detail": detail},
        {"case": "checkpoint_sharded_save_seconds", **stats.summary(single["s"], shard["s"]), "goal": "report",
         "unit": "s",
         "detail": {**detail, "sharded": shard["s"], "single": single["s"]}},
        {"case": "checkpoint_async_stall_seconds", **stats.summary(shard["s"], shard["stall_s"]), "goal": "<= 0.2",
         "unit": "s",
         "detail": {**detail, "async": shard["stall_s"], "sync": shard["s"]}},
    ]
