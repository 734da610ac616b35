"""Whether a run file would start, checked on this machine: every shape divides (config.check, at load, the line
`train` would print), every process group of the plan's mesh forms (on the fake backend, at the run's world size),
and the checkpoint the first save would write is what the resharding loader expects on another layout.

The checkpoint part uses the sharded save's own pieces (resume/sharded/save.py): `model_chunks` and
`optimizer_chunks` of each simulated rank are what its first save writes (single-process names, global shapes,
this rank's piece); a one-process loader's targets (`model_chunks` and `optimizer_targets` of the plain GPT and its
optimizer, on the meta device) are checked against those shapes by the loader's own `_check_targets`, so a save
that another world size could not read fails here with the loader's message.
"""

from typing import Dict, List

from lit_pretrain.errors import DataError


def save_layout(gpt, par, optimizer) -> Dict[str, tuple]:
    """{checkpoint key: (global shape, bytes of this rank's piece)} of what this rank's first save writes."""
    from lit_pretrain.resume.sharded.save import model_chunks, optimizer_chunks

    chunks = {**model_chunks(gpt, par), **optimizer_chunks(gpt, optimizer, par)}
    return {k: (tuple(c.size()), c.local.numel() * c.local.element_size()) for k, c in chunks.items()}


def one_process_targets(config, saved: Dict[str, tuple]) -> Dict[str, tuple]:
    """{key: global shape} a one-process resume of a checkpoint with `saved` shapes reads, checked by the resharding
    loader's own `_check_targets` (a DataError naming the key and the fix when a shape differs or a key is absent)."""
    import torch

    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_optimizer
    from lit_pretrain.planning.plan import sized_model
    from lit_pretrain.resume.sharded.save import _check_targets, model_chunks, optimizer_targets

    with torch.device("meta"):
        gpt = GPT(sized_model(config))
        optimizer = build_optimizer(gpt, config.optim, 0, kernel="foreach")
        shapes = {k: torch.Size(v[0]) for k, v in saved.items()}
        targets = {**model_chunks(gpt, None), **optimizer_targets(gpt, optimizer, None, shapes)}
    present = {k: c for k, c in targets.items() if k in shapes}  # a pipeline stage writes its own layers
    _check_targets(f"{config.run.name} (simulated first save)", present, shapes)
    return {k: tuple(c.size()) for k, c in targets.items()}


def start_check(config, results: List) -> dict:
    """{"ok", "lines"}: the three checks over the simulated ranks `results` (engine.RankResult)."""
    plan = config.plan
    lines = [f"shapes divide: config.check passed for {plan.world_size} ranks ({plan.describe()})"]
    groups = sorted({g for r in results for g in r.groups})
    lines.append("groups form on the fake backend: " + ", ".join(groups))
    saved: Dict[str, tuple] = {}
    for r in results:
        saved.update(r.checkpoint)
    ok = True
    try:
        expected = one_process_targets(config, saved)
    except DataError as err:
        return {"ok": False, "lines": lines + [f"checkpoint: {err}"]}
    unexpected = sorted(set(saved) - set(expected))
    missing = sorted(set(expected) - set(saved))
    stages = {r.coordinates.get("pipeline", 0) for r in results}
    whole = len(stages) == plan.pipeline_parallel
    if unexpected:  # the loader reads what its own parameters need and leaves the rest (resume/sharded/save.py)
        lines.append(f"checkpoint: {len(unexpected)} saved key(s) a one-process resume leaves unread (a layout's "
                     f"own copy, such as the head tensor parallelism unties), e.g. {unexpected[0]}")
    if missing and whole:
        ok = False
        lines.append(f"checkpoint: {len(missing)} key(s) a one-process resume reads are not saved, e.g. {missing[0]}")
    fmt = config.checkpoint.format or ("sharded" if plan.world_size > 1 else "single")
    per_rank = ", ".join(f"rank {r.rank} {sum(b for _, b in r.checkpoint.values()) / 1e9:.3f} GB" for r in results)
    stages_note = "" if whole else " (the simulated pipeline stages only: --ranks corners for all)"
    lines.append(f"checkpoint ({fmt} format): {len(saved)} tensors by single-process name, global shapes as a "
                 f"one-process resume reads them{stages_note}; bytes each rank writes at most: {per_rank}")
    if fmt == "sharded":
        last = f"rank{plan.world_size - 1:05d}.pt"
        lines.append(f"  files: .metadata, manifest.json, trainer_state.pt, rank00000.pt .. {last} and one DCP data "
                     "file per writing rank")
    return {"ok": ok, "lines": lines}


def format_start_check(check: dict) -> str:
    return "start check: " + ("passed" if check["ok"] else "FAILED") + "\n" + "\n".join(
        f"  {line}" for line in check["lines"])
