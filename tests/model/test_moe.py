"""model.moe: the architecture table's counts against the built modules and transformers' OLMoE, the grouped
matmul against a per-expert loop, routing, capacity, the balancing losses and DeepSeek-V3's bias. CPU, float32."""

from pathlib import Path

import pytest
import torch
import yaml

from lit_pretrain.bench.moe.mlp import loop_forward
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig, MoEConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.moe import end_step, moe_layers, moe_loss, step_statistics

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def tiny_moe(**moe) -> GPTConfig:
    args = dict(num_experts=4, top_k=2, d_ff_expert=32)
    args.update(moe)
    return GPTConfig(vocab_size=128, n_layers=3, d_model=64, n_heads=4, seq_len=32, moe=MoEConfig(**args))


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def test_dense_model_has_no_moe_and_the_same_table():
    cfg = GPTConfig(vocab_size=128, n_layers=2, d_model=64, n_heads=4)
    assert cfg.moe is None and not cfg.moe_layers()
    assert shapes.active_params(cfg) == shapes.params(cfg)
    assert not moe_layers(build(cfg)) and moe_loss(build(cfg)) is None


def test_counts_of_a_tiny_moe_equal_the_built_modules_and_the_active_count_by_hand():
    # Layer 0 dense (first_dense_layers=1), layers 1, 2 MoE; 4 experts of 32, top 2, 1 shared expert; tied, V 128.
    cfg = tiny_moe(num_shared_experts=1, first_dense_layers=1)
    model = build(cfg)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["SwiGLU", "MoE", "MoE"]
    assert sum(p.numel() for p in model.parameters()) == shapes.params(cfg)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes.param_shapes(cfg)
    # By hand. Attention 4·64² = 16,384 and 2 norms 128 per block. Dense MLP: hidden 64·ceil(170/64) = 192,
    # 3·64·192 = 36,864. MoE: router 4·64 = 256; experts 3·4·32·64 = 24,576 (active 2 of 4: 12,288); shared
    # 3·32·64 = 6,144. Final norm 64, embedding 128·64 = 8,192 (tied).
    dense = 16_384 + 128 + 36_864
    moe_total, moe_active = 16_384 + 128 + 256 + 24_576 + 6_144, 16_384 + 128 + 256 + 12_288 + 6_144
    assert shapes.params(cfg) == dense + 2 * moe_total + 64 + 8_192
    assert shapes.active_params(cfg) == dense + 2 * moe_active + 64 + 8_192
    assert model.num_params(non_embedding=False, active=True) == shapes.active_params(cfg)
    # FLOPs per token count the active parameters (6·N_active + attention): the built model and the table agree.
    assert model.flops_per_token() == shapes.flops_per_token(cfg)
    assert shapes.flops_per_token(cfg) == 6 * (shapes.active_non_embedding_params(cfg) + 128 * 64) + \
        12 * 3 * 4 * 16 * 32


def test_every_k_places_moe_layers():
    cfg = GPTConfig(vocab_size=64, n_layers=7, d_model=64, n_heads=4,
                    moe=MoEConfig(num_experts=4, top_k=1, first_dense_layers=1, every_k=2))
    assert cfg.moe_layers() == [1, 3, 5]


@pytest.mark.parametrize("moe, key", [(dict(top_k=5), "model.moe.top_k"),
                                      (dict(first_dense_layers=3), "model.moe.first_dense_layers"),
                                      (dict(d_ff_expert=30), "model.moe.d_ff_expert")])
def test_bad_moe_config_names_the_key(moe, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tiny_moe(**moe).check()


def test_olmoe_preset_counts_equal_transformers_olmoe_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    preset = yaml.safe_load((EXPERIMENTS / "model" / "olmoe_1b_7b.yaml").read_text())
    cfg = GPTConfig(**{**preset, "moe": MoEConfig(**preset["moe"])})
    hf_cfg = transformers.OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                      num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        theirs = transformers.OlmoeForCausalLM(hf_cfg)
        ours = GPT(cfg)
    total = sum(p.numel() for p in theirs.parameters())
    # Active: of each experts' stack (gate_up_proj, down_proj: (64, ., .)) a token uses 8 experts: 6.92B total
    # minus 56/64 of 16·64·3·2048·1024 = 6,442,450,944 expert weights.
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts // 64 * 8
    assert shapes.params(cfg) == total == sum(p.numel() for p in ours.parameters()) == 6_919_161_856
    assert shapes.active_params(cfg) == active == 1_282_017_280


@pytest.mark.parametrize("score, norm", [("softmax", False), ("sigmoid", True)])
def test_grouped_matmul_equals_the_per_expert_loop_forward_and_backward(score, norm):
    cfg = tiny_moe(num_experts=8, top_k=2, score=score, norm_topk_prob=norm)
    layer = build(cfg).blocks[0].mlp
    x = torch.randn(2, 16, 64, requires_grad=True)
    g = torch.randn(2, 16, 64)
    ours = layer(x)  # the experts through model/moe_kernels.py (tests/model/test_moe_kernels.py: the kernel alone)
    (ours * g).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    ref = loop_forward(layer, x)  # the bench's per-expert loop (transformers' OlmoeExperts does the same)
    (ref * g).sum().backward()
    # The same products; only the order of each token's sum over its k experts may differ: fp32 rounding.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(grads, [x.grad] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_capacity_drops_the_overflow_and_counts_it():
    cfg = tiny_moe(num_experts=4, top_k=1, capacity_factor=0.5)
    model = build(cfg)
    layer = model.blocks[0].mlp
    with torch.no_grad():  # route every token to expert 0: capacity ceil(0.5·32·1/4) = 4 of its 32 tokens
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.ones(1, 32, 64)
    layer.train()
    out = layer(x)
    assert (out[0, :4].abs().sum(-1) > 0).all() and (out[0, 4:] == 0).all()
    end_step(model)
    stats = step_statistics(layer)
    assert stats["dropped_fraction"].item() == 28 / 32 and stats["max_share"].item() == 1.0


def test_aux_loss_is_one_for_a_uniform_router_and_z_loss_matches_its_formula():
    cfg = tiny_moe(num_experts=4, top_k=2, aux_loss=0.1, router_z_loss=0.01)
    model = build(cfg)
    for layer in moe_layers(model):
        torch.nn.init.zeros_(layer.router.weight)  # uniform probabilities 1/4, logsumexp = log 4
    model(torch.randint(0, 128, (2, 32)))
    # Switch eq. 4 with f summing to 1 over the N·k assignments: E · Σ f_i · 1/E = 1 whatever the split.
    expected = 0.1 * 1.0 + 0.01 * torch.log(torch.tensor(4.0)) ** 2
    torch.testing.assert_close(moe_loss(model), expected)


def test_bias_update_moves_against_the_load_after_the_step_only():
    cfg = tiny_moe(num_experts=4, top_k=1, bias_update_rate=0.1)
    model = build(cfg).train()
    layer = model.blocks[0].mlp
    assert "blocks.0.mlp.expert_bias" in model.state_dict() and layer.expert_bias.requires_grad is False
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0  # expert 2 takes every token of a positive input
    layer(torch.ones(1, 8, 64))
    assert layer.expert_bias.abs().sum() == 0  # the forward never moves it
    end_step(model)
    # DeepSeek-V3 §2.1.2: b_i += rate · sign(mean load − load_i): expert 2 (load 8 > 2) down, the others up.
    assert layer.expert_bias.tolist() == pytest.approx([0.1, 0.1, -0.1, 0.1])
    assert step_statistics(layer)["bias_norm"].item() == pytest.approx(0.2)


def test_planted_router_collapse_is_an_event_with_a_label_and_resolves():
    from types import SimpleNamespace

    from lit_pretrain.callbacks.moe_monitor import LABEL, MoEMonitor

    model = build(tiny_moe(num_experts=4, top_k=1)).train()
    logged = {}
    module = SimpleNamespace(model=model, log=lambda key, value: logged.__setitem__(key, value))
    monitor = MoEMonitor(log_every_n_steps=1, collapse_share=0.5, window=2)
    x = torch.randint(0, 128, (2, 32))

    def step(n, collapse):
        # Plant the collapse: layer 1 routes every token to expert 3 (its router's own scores otherwise).
        for m in moe_layers(model):
            m.route = (lambda f, m=m: _route_to(m, f, 3 if collapse and m.layer == 1 else None))
        model(x)
        end_step(model)
        monitor.on_train_batch_end(SimpleNamespace(global_step=n, max_steps=100), module, None, None, 0)

    step(1, True)
    assert monitor.events == []  # one logged step above the share is not yet a collapse (window 2)
    step(2, True)
    assert [(e["label"], e["step"], e["layer"], e["expert"], e["share"]) for e in monitor.events] == \
        [(LABEL, 2, 1, 3, 1.0)]
    assert logged["moe/layer1/max_share"] == 1.0 and logged["moe/layer0/max_share"] < 0.5
    from lit_pretrain.callbacks.stability_report import format_report

    line = [ln for ln in format_report({"router_collapse": monitor.summary(), "updates_skipped": 0,
                                        "steps_rewound": 0, "batches_skipped": 0, "tokens_skipped": 0}).splitlines()
            if "router collapse" in ln]
    assert line == ["  router collapse      1 (layer 1 expert 3 at step 2); 1 open"]
    step(3, False)
    assert monitor.events[0]["resolved_step"] == 3 and monitor.summary()["open"] == 0


def _route_to(layer, flat, expert):
    """The layer's own routing, or every token to `expert` with weight 1 (a planted collapse)."""
    from lit_pretrain.model.moe import MoE

    top, weights, scores, logits = MoE.route(layer, flat)
    if expert is None:
        return top, weights, scores, logits
    return torch.full_like(top, expert), torch.ones_like(weights), scores, logits


@pytest.mark.parametrize("overrides, key", [
    # tensor and pipeline parallelism compose (tests/parallel/test_moe_mesh.py); the shared experts split in whole units
    (["strategy=tensor", "strategy.tensor_parallel=3", "trainer.devices=3", "model.moe.num_shared_experts=1",
      "model.moe.d_ff_expert=8"], "model.moe.num_shared_experts"),
    # each rank holds a slice of every routed expert's width: 8 / 2 = 4 units, not a multiple of 8 (16-byte rows)
    (["strategy=tensor", "strategy.tensor_parallel=2", "trainer.devices=2", "model.moe.d_ff_expert=8"],
     "model.moe.d_ff_expert"),
    (["trainer.compile=true"], "trainer.compile"),
    (["optim.name=muon"], "optim.name"),
    (["model.moe.top_k=9"], "model.moe.top_k"),
    (["strategy=ddp", "strategy.expert_parallel=3", "trainer.devices=4"], "strategy.expert_parallel"),
    (["strategy=zero", "strategy.zero_stage=1", "strategy.expert_parallel=2", "trainer.devices=2"],
     "strategy.zero_stage"),
    (["strategy=ddp", "strategy.expert_parallel=3", "trainer.devices=3"], "model.moe.num_experts"),
])
def test_config_load_refuses_what_moe_does_not_compose_with_naming_the_key(overrides, key):
    from lit_pretrain import config
    from lit_pretrain.errors import ConfigError

    moe = "model.moe={num_experts: 4, top_k: 2}"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):  # config.load checks the ranges and the plan
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [moe, *overrides])


def test_expert_parallel_without_moe_is_refused_naming_the_key():
    from lit_pretrain import config
    from lit_pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"strategy\.expert_parallel=2 .*model\.moe is null"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["strategy=ddp", "strategy.expert_parallel=2",
                                                          "trainer.devices=2"])


def test_olmoe_preset_loads_as_a_model_group():
    from lit_pretrain import config

    # one 4,096-token window a step (tiny.yaml's 512 tokens are for its own 64-token windows)
    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["model=olmoe_1b_7b", "trainer.micro_batch_size=1",
                                                           "trainer.tokens_per_step=null"])
    model = config.to_object(cfg).model
    assert model.moe.num_experts == 64 and model.qk_norm_scope == "projection" and model.moe_layers() == list(range(16))


# ---------------------------------------------------------------------------------------------- HF (OLMoE)

def tiny_olmoe(seed: int = 0, **moe) -> GPT:
    """An OLMoE-shaped tiny model (every layer MoE, projection-scope QK-norm, untied) with settings away from
    OlmoeConfig's defaults (8 experts, top 3, norm_topk_prob true, rope_theta 500, grouped-query attention), init_std
    0.2 and norm weights in [0.5, 1.5] so the logits have a trained model's size (as tests/interop/test_hf.py's
    tiny_gpt)."""
    args = dict(num_experts=8, top_k=3, d_ff_expert=48, norm_topk_prob=True)
    args.update(moe)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, seq_len=32,
                          tie_embeddings=False, qk_norm=True, qk_norm_scope="projection", rope_theta=500.0,
                          init_std=0.2, moe=MoEConfig(**args)))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from lit_pretrain.data.tokenizer import save_tokenizer, train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(["def route(token): return top_k(experts)\n" * 3] * 20, 300), path)
    return path


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_olmoe_export_holds_every_expert_gives_transformers_logits_and_round_trips_bitwise(
        tmp_path, tokenizer_file, monkeypatch, norm_topk_prob):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from lit_pretrain.interop.hf import export_gpt, load_init, read_hf_config, write_weights
    from lit_pretrain.interop.llama import function_fields

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_olmoe(norm_topk_prob=norm_topk_prob)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    # Every expert of every layer, each projection its own tensor: 2 layers x 8 experts x 3 = 48.
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3 and "model.layers.1.mlp.experts.7.down_proj.weight" in experts
    assert read_hf_config(tmp_path / "hf") == {**function_fields(model.cfg), "seq_len": 32}

    theirs = transformers.OlmoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "OlmoeForCausalLM" and theirs.config.norm_topk_prob == norm_topk_prob
    idx = torch.randint(0, 320, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, hf = model(idx), theirs(idx).logits
    assert ours.abs().max() > 2
    # The same products in fp32; the order of each token's sum over its k experts and the attention kernel's
    # summation differ: rounding of ~1e-7 relative at logits of a few units.
    diff = (hf - ours).abs().max().item()
    print(f"max |logit difference| OLMoE (norm_topk_prob={norm_topk_prob}): {diff:.3g}")
    assert diff <= 1e-5

    # `lit-pretrain import`'s model.* overrides load as a config that builds this model.
    from lit_pretrain import config
    from lit_pretrain.interop.hf import import_overrides

    loaded = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", import_overrides(tmp_path / "hf")))
    assert function_fields(loaded.model) == function_fields(model.cfg)

    weights = write_weights(tmp_path / "hf", tmp_path / "init.safetensors")  # `import --out`
    for source in (tmp_path / "hf", weights):  # run.init_from: the folder, or the file under our names
        fresh = load_init(tiny_olmoe(seed=7, norm_topk_prob=norm_topk_prob), source, tokenizer_file)
        for name, tensor in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), (source, name)


def test_olmoe_import_reads_transformers_fused_expert_layout(tmp_path, tokenizer_file):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from lit_pretrain.interop.hf import export_gpt, load_init

    model = tiny_olmoe()
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    # transformers 5 holds the experts fused in memory, gate_up_proj (E, 2f, d) and down_proj (E, d, f) per layer
    # (its save_pretrained writes the hub's per-expert names back): a file in that layout imports the same weights.
    state = transformers.OlmoeForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "hf" / "model.safetensors")
    fresh = load_init(tiny_olmoe(seed=7), tmp_path / "hf", tokenizer_file)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_olmoe_import_refuses_a_missing_expert(tmp_path, tokenizer_file):
    from safetensors.torch import load_file, save_file

    from lit_pretrain.errors import DataError
    from lit_pretrain.interop.hf import export_gpt, load_init

    export_gpt(tiny_olmoe(), tokenizer_file, tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]  # a converter that dropped one expert
    save_file(state, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(DataError, match=r"layer 1 lacks experts \[5\] of its up projection"):
        load_init(tiny_olmoe(seed=7), tmp_path / "hf", tokenizer_file)


@pytest.mark.parametrize("key, moe, model", [
    ("model.moe.num_shared_experts", dict(num_shared_experts=1), {}),
    ("model.moe.bias_update_rate", dict(bias_update_rate=0.01), {}),
    ("model.moe.score", dict(score="sigmoid"), {}),
    ("model.moe.first_dense_layers", dict(first_dense_layers=1), {}),
    ("model.qk_norm_scope", {}, dict(qk_norm_scope="head")),
])
def test_olmoe_export_refuses_what_it_cannot_express_naming_the_key(tmp_path, tokenizer_file, key, moe, model):
    from dataclasses import replace

    from lit_pretrain.errors import DataError
    from lit_pretrain.interop.hf import export_gpt

    cfg = tiny_olmoe().cfg
    cfg = replace(cfg, moe=replace(cfg.moe, **moe), **model)
    with pytest.raises(DataError, match=key.replace(".", r"\.") + ".*cannot be expressed"):
        export_gpt(build(cfg), tokenizer_file, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_the_default_moe_refusal_names_every_key_to_train_with_and_they_export(tmp_path, tokenizer_file):
    """model.moe with the tiny model's defaults (per-head or no QK-norm) is not an OLMoE: the refusal lists every key
    to set, and a model trained with them exports."""
    from lit_pretrain import config
    from lit_pretrain.errors import DataError
    from lit_pretrain.interop.hf import export_gpt

    tiny, moe = EXPERIMENTS / "runs" / "tiny.yaml", ["model.moe={num_experts: 4, top_k: 2}", "model.vocab_size=320"]
    with pytest.raises(DataError) as err:
        export_gpt(build(config.to_object(config.load(tiny, moe)).model), tokenizer_file, tmp_path / "a")
    assert str(err.value) == (
        "model.qk_norm=False cannot be expressed by transformers' OlmoeForCausalLM (it has True): this model cannot "
        "be exported to Hugging Face format; a mixture-of-experts model exports as OLMoE when trained with "
        "model.qk_norm=true model.qk_norm_scope=projection (as model=olmoe_1b_7b is)")
    fix = str(err.value).split("trained with ")[1].split(" (")[0].split()
    export_gpt(build(config.to_object(config.load(tiny, [*moe, *fix])).model), tokenizer_file, tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").is_file()


@pytest.mark.parametrize("experts, k, width, shared", [(4, 2, 32, 0), (8, 2, 32, 0), (4, 1, 64, 1), (8, 1, 32, 0)])
def test_memory_planner_counts_an_moe_blocks_saved_activations_within_3_percent(experts, k, width, shared):
    from lit_pretrain.parallel.memory import SavedActivations
    from lit_pretrain.planning import memory
    from lit_pretrain.planning.plan import ParallelPlan

    cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, seq_len=16,
                    moe=MoEConfig(num_experts=experts, top_k=k, d_ff_expert=width, num_shared_experts=shared))
    model = build(cfg)
    block = model.blocks[0]
    h = model.tok_embeddings(torch.randint(0, 64, (3, 16)))  # (B, T, d): the block's input, not a leaf
    with SavedActivations(model) as meter:
        block(h, model.rope_cos, model.rope_sin)
    planned = memory.block_activation_bytes(16, 3, 32, 4, cfg.hidden_dim, moe=(experts, k, width, shared))
    # Measured 0.4-0.7% above the plan on these shapes: a few per-token scalars of the routing are not counted.
    assert planned <= meter.bytes <= 1.03 * planned
    assert memory.memory_plan(ParallelPlan(),
                              cfg, 3, precision="32-true")["activation_bytes_per_layer"] == planned  # fp32


def test_memory_command_takes_moe_and_counts_olmoe_as_transformers_does(capsys):
    import json

    from lit_pretrain.scaling.cli import main

    olmoe = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--vocab", "50304", "--seq-len", "4096",
             "--untied", "--model", "qk_norm=true", "--model", "qk_norm_scope=projection", "--model",
             "moe={num_experts: 64, top_k: 8, d_ff_expert: 1024, norm_topk_prob: false}"]
    assert main(["memory", *olmoe, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["active_params"]) == (6_919_161_856, 1_282_017_280)  # as OlmoeForCausalLM's
    # selective with model.moe (refused before): between full and none per layer, no matmul recomputed
    rows = {}
    for mode in ("none", "selective", "full"):
        assert main(["memory", *olmoe, "--activation-checkpointing", mode, "--json"]) == 0
        rows[mode] = json.loads(capsys.readouterr().out)
    per_layer = {mode: row["activation_bytes_per_layer"] for mode, row in rows.items()}
    assert per_layer["full"] < per_layer["selective"] < per_layer["none"], per_layer
    assert rows["selective"]["recompute_flops"] == {"matmul": 0.0, "attention": 0.0}
    assert main(["memory", "--params", "1e8", "--model", "moe={num_experts: 4}"]) == 2
    assert "--params searches dense shapes" in capsys.readouterr().err
    assert main(["memory", *olmoe[:6], "--model", "moe={experts: 4}"]) == 2
    assert "--model moe=" in capsys.readouterr().err


def test_a_checkpoint_written_before_model_moe_resumes_unless_a_new_key_left_its_default():
    from lit_pretrain.errors import ConfigError
    from lit_pretrain.resume import compat

    manifest = {"tokenizer": {"sha256": "t"}, "splits": {}}
    before = {"model": {"d_model": 64}, "trainer": {"devices": 1}}  # keys of a run that predates model.moe
    now = {"model": {"d_model": 64, "moe": None, "qk_norm_scope": "head"}, "trainer": {"devices": 1},
           "callbacks": {"moe": {"enabled": True, "collapse_share": 0.5}}}
    saved = compat.run_meta(before, manifest, 512)
    assert compat.check_resume(saved, compat.run_meta(now, manifest, 512), [], "c", "t") == []
    moe = {**now, "model": {**now["model"], "moe": {"num_experts": 4}}}
    with pytest.raises(ConfigError, match="model.moe.num_experts .*cannot change"):
        compat.check_resume(saved, compat.run_meta(moe, manifest, 512), [], "c", "t")


def test_memory_planner_splits_the_routed_experts_by_expert_and_tensor_parallelism():
    """OLMoE-1B-7B (the preset; 6,442,450,944 routed-expert weights of 6,919,161,856, counted above against
    transformers): expert parallelism 8 leaves each rank 1/8 of the experts, with their state sharded over the
    64 / 8 = 8 ranks holding the same experts at ZeRO-3; tensor parallelism splits the dense matrices and each routed
    expert along its width (parallel/expert_tensor.py), not the router; both together leave 1/16 of the experts."""
    from lit_pretrain.errors import ConfigError
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan

    preset = yaml.safe_load((EXPERIMENTS / "model" / "olmoe_1b_7b.yaml").read_text())
    cfg = GPTConfig(**{**preset, "moe": MoEConfig(**preset["moe"])})
    routed = 16 * 64 * 3 * 1024 * 2048
    assert routed == 6_442_450_944
    whole = memory_plan(ParallelPlan(data_parallel_shard=64, zero_stage=3), cfg, 1, precision="32-true")
    ep8 = memory_plan(ParallelPlan(data_parallel_shard=64, zero_stage=3, expert_parallel=8),
                      cfg, 1, precision="32-true")
    assert whole["params_per_device"] == 6_919_161_856
    assert ep8["params_per_device"] == 6_919_161_856 - routed + routed // 8
    # ZeRO-3 over 64 ranks: every parameter / 64 either way (the experts / 8 / 8), 4 bytes each in fp32
    assert ep8["param_bytes"] == pytest.approx(4 * 6_919_161_856 / 64)
    ep8_zero0 = memory_plan(ParallelPlan(data_parallel_shard=64, zero_stage=0, expert_parallel=8),
                            cfg, 1, precision="32-true")
    assert ep8_zero0["param_bytes"] == 4 * (6_919_161_856 - routed + routed // 8)
    tp2 = memory_plan(ParallelPlan(data_parallel_shard=1, zero_stage=0, tensor_parallel=2), cfg, 1, precision="32-true")
    norms = 16 * 2 * 2048 + 16 * 2 * 2048 + 2048  # two RMSNorms a block, QK-norm over the projections, final norm
    embeddings = 2 * 50304 * 2048
    router = 16 * 64 * 2048  # replicated over tensor parallelism: every rank routes the same tokens
    split = 6_919_161_856 - router - norms - embeddings  # every matrix of the blocks, the routed experts included
    assert tp2["params_per_device"] == split / 2 + router + norms + embeddings / 2
    # EP 8 x TP 2 (64 data-parallel ranks, 128 in all): E/8 experts x 1/2 of their width, their state sharded at
    # ZeRO-3 over the 64 / 8 = 8 ranks holding the same slices; the dense part over all 64.
    ep8_tp2 = memory_plan(ParallelPlan(data_parallel_shard=64, zero_stage=3, expert_parallel=8, tensor_parallel=2),
                          cfg, 1, precision="32-true")
    dense = (split - routed) / 2 + router + norms + embeddings / 2
    assert ep8_tp2["params_per_device"] == dense + routed / 16
    assert ep8_tp2["param_bytes"] == pytest.approx(4 * (dense / 64 + routed / 16 / 8))
    with pytest.raises(ConfigError, match="--expert-parallel 3"):
        memory_plan(ParallelPlan(expert_parallel=3), cfg, 1)
    narrow = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, moe=MoEConfig(d_ff_expert=10))
    with pytest.raises(ConfigError, match="--tensor-parallel 4 must divide the experts' width 10"):
        memory_plan(ParallelPlan(tensor_parallel=4), narrow, 1)


def test_global_aux_loss_scope_makes_the_ranks_mean_one_process_loss_and_gradient():
    """model.moe.aux_loss_scope=global on two data-parallel ranks, played in one process: each half of the batch
    with the other half's counts added by `count_reduce` (the all-reduce parallel/moe_mesh.py installs). The mean
    of the two ranks' auxiliary losses, and its router gradient, equal one process's over the whole batch; with the
    micro-batch scope they do not (f_i · P_i is a product of two batch means)."""
    torch.manual_seed(0)
    layer = build(tiny_moe(num_experts=4, top_k=2, aux_loss=0.01, aux_loss_scope="global")).blocks[0].mlp
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        counts = [torch.bincount(layer.route(h.reshape(-1, 64))[0].flatten(), minlength=4).float() for h in x]

    def aux_and_grad(halves, others):
        layer.zero_grad()
        total = 0
        for h, other in zip(halves, others):
            layer.count_reduce = None if other is None else (lambda t, o=other: t + o)
            layer(h)
            total = total + layer.last_losses[0] / len(halves)
        total.backward()
        return total.item(), layer.router.weight.grad.clone()

    whole, whole_grad = aux_and_grad([x], [None])
    ranks, ranks_grad = aux_and_grad([x[:1], x[1:]], [counts[1], counts[0]])
    # The same sums in another order: fp32 rounding of values ~1 and gradients ~1e-2.
    assert ranks == pytest.approx(whole, abs=1e-6)
    torch.testing.assert_close(ranks_grad, whole_grad, rtol=1e-5, atol=1e-7)
    local, local_grad = aux_and_grad([x[:1], x[1:]], [None, None])  # count_reduce unset: each rank's own f_i
    # measured 2.3e-3 in the loss and 1.7e-2 in the gradient: three orders above the rounding bounds
    assert abs(local - whole) > 1e-4 and (local_grad - whole_grad).abs().max() > 1e-4, (local - whole)
