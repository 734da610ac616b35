"""The one loss path's variants under the layouts that split the head or its positions, each one training step
against one process from the same weights: model.loss_chunk_size under the vocabulary-parallel head (TP 2, with and
without sequence parallelism), the pipeline's last stage and context parallelism (against the whole window); and
model.mtp_depth under tensor parallelism (its blocks split like the main ones, the shared head vocabulary-parallel),
context parallelism with document masking (its blocks' attention over the gathered keys) and pipeline parallelism
(the modules on the last stage). One 2-process spawn runs every case."""

import pytest
import torch.multiprocessing as mp

from lit_pretrain.planning.plan import ParallelPlan as Plan
from tests.conftest import free_port
from tests.helpers.loss_path_workers import worker

pytestmark = pytest.mark.slow

CHUNK = {"loss_chunk_size": 5}  # 16 positions: chunks of 5, 5, 5, 1 (a short last chunk); under SP 8 per rank
CASES = [
    ("tp2", Plan(tensor_parallel=2), CHUNK),
    ("tp2_sp_softcap", Plan(tensor_parallel=2, sequence_parallel=True), {**CHUNK, "logit_softcap": 0.3}),
    ("pp2_1f1b", Plan(pipeline_parallel=2, schedule="1f1b", micro_batches=4), CHUNK),
    ("cp2", Plan(context_parallel=2), {**CHUNK, "tie_embeddings": False}),
    ("tp2_mtp2", Plan(tensor_parallel=2), {"mtp_depth": 2}),
    ("tp2_mtp_chunked_untied", Plan(tensor_parallel=2), {**CHUNK, "mtp_depth": 1, "tie_embeddings": False}),
    ("cp2_mtp2_documents", Plan(context_parallel=2), {"mtp_depth": 2, "eod_id": 5}),
    # the modules on the last stage, after the head; untied, that stage keeps its own copy of the embedding
    ("pp2_mtp_untied", Plan(pipeline_parallel=2, schedule="1f1b", micro_batches=4),
     {"mtp_depth": 1, "tie_embeddings": False}),
    ("pp2_mtp2_chunked", Plan(pipeline_parallel=2, schedule="gpipe", micro_batches=2), {**CHUNK, "mtp_depth": 2}),
]


def test_chunked_loss_and_mtp_match_one_process_under_each_layout():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(2, free_port(), CASES, results), nprocs=2, join=True,
                           start_method="forkserver")
        results = dict(results)
    assert sorted(results) == sorted(name for name, *_ in CASES)
    for name, r in results.items():
        # fp32 sums in another order (chunks, the vocabulary all-reduce, the micro-batches' mean): losses of ~4
        # within a few ulps (4.8e-7 each), the z-loss (1e-3 x log(Z)^2 ~ 0.02) likewise; gradients ~1e-2 within
        # 1e-6 as tests/parallel/test_mesh_parallel.py bounds them. A chunk's targets misaligned with its logits
        # (sequence parallelism's rank order) moves the loss by ~1e-2.
        assert r["task"] < 2e-6 and r["z"] < 2e-7, (name, r)
        assert (r["mtp"] is None) == ("mtp" not in name) and (r["mtp"] or 0.0) < 2e-6, (name, r)
        assert r["grad_keys"] and r["grad"] < 1e-6, (name, r)
