"""Sliding-window attention with a local-global pattern under tensor, pipeline and context parallelism, against one
process built from the same weights (tests/helpers/mesh_workers.py: losses, norms, first-step gradients, weights and
AdamW moments after K steps, as tests/parallel/test_mesh_parallel.py checks every layout). One 2-process spawn runs
every case: process start-up is the cost."""

import pytest

from lit_pretrain.planning.plan import ParallelPlan as Plan
from tests.parallel.test_mesh_parallel import check, spawn

pytestmark = pytest.mark.slow

# mesh_workers' model: 4 layers, windows of 16 positions. A window of 3 with every second layer global (GPT-OSS's
# alternation); under context parallelism 2 the window is cut into 4 chunks of 4, so a window of 3 reaches across
# every chunk edge into the previous chunk, held by the other rank. Documents (eod 5) cross the chunk edges too.
WINDOW = {"sliding_window": 3, "global_attention_every": 2}
CASES = [
    ("tp2_window", Plan(tensor_parallel=2), WINDOW),
    ("pp2_window", Plan(pipeline_parallel=2, schedule="1f1b", micro_batches=4),
     {"sliding_window": 3, "layer_types": ["sliding", "sliding", "full", "sliding"]}),  # a window on both stages
    ("cp2_window", Plan(context_parallel=2), {**WINDOW, "n_kv_heads": 2}),
    ("cp2_window_documents", Plan(context_parallel=2), {**WINDOW, "eod_id": 5}),
]


def test_sliding_window_layouts_match_one_process():
    results = spawn(2, CASES)
    check(results, [c[0] for c in CASES])
