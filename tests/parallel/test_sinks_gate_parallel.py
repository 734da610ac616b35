"""Attention sinks and gated attention under tensor (with sequence), pipeline and context parallelism against one
process built from the same weights, in one 2-process spawn: losses, pre-clip norms, first-step gradients, the
weights and AdamW moments gathered to single-process names after K steps, as tests/parallel/test_mesh_parallel.py
checks every layout. Under tensor parallelism each rank holds its heads' sinks and gate rows; under context
parallelism each query's softmax is one SDPA call over the gathered keys, so a sink joins it once."""

import pytest

from lit_pretrain.planning.plan import ParallelPlan as Plan
from tests.parallel.test_mesh_parallel import check, spawn

pytestmark = pytest.mark.slow

SINKS_GATE = dict(attention_sinks=True, attention_gate="elementwise", n_kv_heads=2)
CASES = [
    ("tp2_sinks_gate", Plan(tensor_parallel=2), SINKS_GATE),
    ("tp2_sp_sinks_headwise", Plan(tensor_parallel=2, sequence_parallel=True),
     dict(attention_sinks=True, attention_gate="headwise")),
    ("pp2_sinks_gate", Plan(pipeline_parallel=2, schedule="1f1b", micro_batches=4), SINKS_GATE),
    # causal chunks (two SDPA calls per rank over the keys up to each chunk's end) and documents across the edges
    ("cp2_sinks_gate", Plan(context_parallel=2), SINKS_GATE),
    ("cp2_documents_sinks", Plan(context_parallel=2), {**SINKS_GATE, "eod_id": 5}),
]


def test_sinks_and_gate_under_tp_pp_cp_match_one_process():
    results = spawn(2, CASES)
    check(results, [c[0] for c in CASES])
