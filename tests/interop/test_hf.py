"""Export to and import from Hugging Face transformers: the same logits and greedy tokens as transformers'
LlamaForCausalLM, a bitwise round trip, a tokenizer transformers loads, and one-line refusals of what Llama or our
GPT cannot express. Nothing downloads: every model and tokenizer comes from a local folder."""

import json
from dataclasses import replace

import pytest
import torch

from lit_pretrain import cli, config
from lit_pretrain.data.tokenizer import EOD, eod_id, load_tokenizer, save_tokenizer, train_tokenizer
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.interop.hf import export_gpt, export_run, load_init, read_hf_config, write_weights
from lit_pretrain.interop.llama import function_fields
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.resume.weights import load_gpt
from tests.conftest import EXPERIMENTS, tiny_data_overrides

pytest.importorskip("transformers")  # the hf extra: installed by `make install` and CI
pytest.importorskip("safetensors")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Matrices of 64 columns: more threads only add synchronization, which on a loaded 2-core machine made greedy
    # generation 20x slower (0.7 s with one thread, 14 s with two).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(["def export(model): return model.to_hf()\n" * 3] * 20, 300), path)
    return path


def tiny_gpt(tied: bool, seed: int = 0) -> GPT:
    """Every setting away from Llama's defaults (rms_norm_eps 1e-6, rope_theta 1e4, 8/3 MLP, untied), so a field the
    export forgets shows; a vocabulary larger than the tokenizer's, as a padded one would be. init_std 0.2 and norm
    weights in [0.5, 1.5] give logits of a few units, as a trained model's, so 1e-5 is a test at ~1e-6 relative,
    and a swapped norm (attn_norm for mlp_norm) changes them."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, d_ff=96, seq_len=32, tie_embeddings=tied,
                          rope_theta=500.0, norm_eps=1e-5, init_std=0.2))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def hf_model(folder, **kwargs):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_llama(tmp_path, tokenizer_file, tied):
    model = tiny_gpt(tied)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    idx = torch.randint(0, 320, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
    assert ours.abs().max() > 2  # the logits are of a trained model's size (see tiny_gpt)
    # sdpa is transformers' default attention; eager is its reference (explicit softmax(q kᵀ * head_dim**-0.5)).
    for attention in ("sdpa", "eager"):
        theirs = hf_model(tmp_path / "hf", attn_implementation=attention)
        assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == tied
        with torch.no_grad():
            diff = (theirs(idx).logits - ours).abs().max().item()
        print(f"max |logit difference| ({'tied' if tied else 'untied'}, {attention}): {diff:.3g}")
        # Same operations in the same order up to the attention kernel's summation order: fp32 rounding only.
        # Measured: 0 (sdpa) and up to 1.01e-5 (eager, untied) on an AMX Xeon, under 1e-5 on the CPU before;
        # 5e-5 leaves that margin, while an export error (a swapped or transposed weight) moves logits by O(1).
        assert diff <= 5e-5, attention


def greedy(model: GPT, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by recomputing the whole prefix at every step (no cache): the plainest reference."""
    with torch.no_grad():
        for _ in range(new_tokens):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)  # (B, T + 1)
    return idx


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_greedy_generation_matches_transformers(tmp_path, tokenizer_file, tied):
    model = tiny_gpt(tied, seed=2)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    prompt = torch.randint(0, 320, (2, 6), generator=torch.Generator().manual_seed(3))
    ours = greedy(model, prompt, 26)  # to model.seq_len = 32
    # transformers decodes with its KV cache; eos_token_id=None: all 26 tokens even past an end-of-document.
    theirs = hf_model(tmp_path / "hf").generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=26,
                                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(set(ours[:, 6:].flatten().tolist())) > 10  # a real sequence, not one token repeated
    assert torch.equal(theirs, ours)


def test_exported_tokenizer_puts_the_end_of_document_token_first_as_generate_does(tmp_path, tokenizer_file):
    """`lit-pretrain generate` decodes from [EOD, prompt ids] (the shards put EOD before every document); the exported
    tokenizer adds the same EOD, so transformers' greedy tokens from AutoTokenizer's ids are generate's."""
    from transformers import AutoTokenizer

    from lit_pretrain.evaluation.generate import generate, prompt_ids

    model = tiny_gpt(tied=True, seed=2)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    ours, text = load_tokenizer(tokenizer_file), "def export(model):"
    ids = prompt_ids(ours, eod_id(ours), text)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    batch = theirs(text, return_tensors="pt")
    assert batch.input_ids[0].tolist() == ids and ids[0] == eod_id(ours)
    assert theirs.decode(batch.input_ids[0], skip_special_tokens=True) == text
    new = generate(model, ids, 32 - len(ids), temperature=0).tokens[0]  # greedy, to model.seq_len
    out = hf_model(tmp_path / "hf").generate(**batch, max_new_tokens=len(new), do_sample=False, eos_token_id=None,
                                             pad_token_id=0)
    assert len(set(new)) > 5  # a real sequence, not one token repeated
    assert out[0].tolist() == ids + new


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_then_import_round_trips_bitwise(tmp_path, tokenizer_file, tied):
    model = tiny_gpt(tied)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]
    assert read_hf_config(tmp_path / "hf") == {**function_fields(model.cfg), "seq_len": 32}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied  # a tied matrix is stored once, as transformers does

    weights = write_weights(tmp_path / "hf", tmp_path / "init.safetensors")  # `import --out`
    for source in (tmp_path / "hf", weights):  # run.init_from: the folder itself, or the file under our names
        fresh = load_init(tiny_gpt(tied, seed=7), source, tokenizer_file)
        assert fresh.state_dict().keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), (source, name)
        assert (fresh.lm_head.weight is fresh.tok_embeddings.weight) == tied


def test_export_refuses_a_weight_llama_cannot_express(tmp_path, tokenizer_file):
    model = tiny_gpt(tied=True)
    model.blocks[1].attn.wq = torch.nn.Linear(64, 64, bias=True)  # a variant with a q bias
    with pytest.raises(DataError, match=r"'blocks\.1\.attn\.wq\.bias'.*cannot be exported"):
        export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []  # no folder, no staging left behind


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_attention_exports_with_transformers_logits(tmp_path, tokenizer_file, kv_heads):
    """n_kv_heads -> num_key_value_heads: transformers' repeat_kv must pair each query head with the key/value head
    our SDPA enable_gqa pairs it with (h // group), or the logits differ at once."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=kv_heads, d_ff=96, seq_len=32,
                          tie_embeddings=False, rope_theta=500.0, init_std=0.2)).eval()
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == kv_heads
    assert read_hf_config(tmp_path / "hf")["n_kv_heads"] == kv_heads
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        theirs = hf_model(tmp_path / "hf", attn_implementation="eager")(idx).logits
    assert ours.abs().max() > 2
    assert (theirs - ours).abs().max().item() <= 1e-5  # fp32 rounding only, as for multi-head attention


def test_qk_norm_exports_as_qwen3_with_transformers_logits_and_round_trips(tmp_path, tokenizer_file):
    """model.qk_norm -> Qwen3ForCausalLM (Llama + per-head q/k RMSNorm before RoPE), grouped-query attention too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, qk_norm=True, d_ff=96,
                          seq_len=32, tie_embeddings=False, rope_theta=500.0, init_std=0.2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)  # a swapped q_norm / k_norm shows
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        assert ours.abs().max() > 2
        assert (theirs(idx).logits - ours).abs().max().item() <= 1e-5
    assert read_hf_config(tmp_path / "hf") == {**function_fields(model.cfg), "seq_len": 32}
    fresh = load_init(GPT(model.cfg), tmp_path / "hf", tokenizer_file)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["query_projected", "query_compressed"])
def test_latent_attention_exports_as_deepseek_v3_with_transformers_logits_and_round_trips(tmp_path, tokenizer_file,
                                                                                          q_lora_rank):
    """model.attention=mla -> a dense DeepseekV3ForCausalLM (first_k_dense_replace = n_layers, rope_interleave
    false): the same logits as transformers' own DeepseekV3Attention, also from its latent KV cache, and back
    bitwise. Every 1-d weight in [0.5, 1.5], so a swapped q_a_layernorm / kv_a_layernorm shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    mla = {"kv_lora_rank": 16, "q_lora_rank": q_lora_rank, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12,
           "v_head_dim": 10}
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, d_ff=96, seq_len=32, tie_embeddings=False,
                          rope_theta=500.0, init_std=0.2, attention="mla", mla=mla)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        assert ours.abs().max() > 2
        for attention in ("sdpa", "eager"):
            theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation=attention).eval()
            assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
            # fp32, logits of a few units: 1e-5 is a few ulps of them; a missing latent norm or a rope in the
            # interleaved layout moves them by ~1
            assert (theirs(idx).logits - ours).abs().max().item() <= 1e-5, attention
        # transformers' cache holds the latents too: its last logits after a prefix and one token are ours
        out = theirs(idx[:, :20], use_cache=True)
        step = theirs(idx[:, 20:21], cache=out.past_key_values, use_cache=True).logits[:, -1]
        assert (step - ours[:, 20]).abs().max().item() <= 1e-5
    assert read_hf_config(tmp_path / "hf") == {**function_fields(model.cfg), "seq_len": 32}
    fresh = load_init(GPT(model.cfg), tmp_path / "hf", tokenizer_file)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("qk_norm,arch", [(False, "MinistralForCausalLM"), (True, "Qwen3ForCausalLM")])
def test_sliding_windows_export_with_their_layer_types_with_transformers_logits_and_round_trip(
        tmp_path, tokenizer_file, qk_norm, arch):
    """model.sliding_window with a local-global pattern -> transformers' sliding_window and layer_types (Ministral's,
    or Qwen3's with model.qk_norm): a window of 5 in a window of 32 positions, layers 0 and 2 local."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=320, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, qk_norm=qk_norm, d_ff=96,
                    seq_len=32, tie_embeddings=False, rope_theta=500.0, init_std=0.2, sliding_window=5,
                    layer_types=["sliding", "full", "sliding"])
    model = GPT(cfg).eval()
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [arch] and written["sliding_window"] == 5
    assert written["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    assert type(theirs).__name__ == arch
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        # transformers' mask and ours, the same keys: fp32 rounding only (a window off by one moves them by ~1e-1)
        assert (theirs(idx).logits - ours).abs().max().item() <= 1e-5
        assert (GPT(replace(cfg, sliding_window=None, layer_types=None)).eval()(idx) - ours).abs().max() > 1e-2
    assert read_hf_config(tmp_path / "hf") == {**function_fields(model.cfg), "seq_len": 32}
    fresh = load_init(GPT(model.cfg), tmp_path / "hf", tokenizer_file)
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in model.state_dict().items())
    # said with model.global_attention_every instead: the same function, the same layers
    assert function_fields(replace(cfg, layer_types=None, global_attention_every=2)) == function_fields(cfg)


def test_a_sliding_window_with_experts_is_refused_naming_the_key(tmp_path, tokenizer_file):
    cfg = GPTConfig(vocab_size=320, n_layers=1, d_model=64, n_heads=4, seq_len=32, sliding_window=8,
                    moe={"num_experts": 2, "top_k": 1})
    with pytest.raises(DataError, match=r"^model\.sliding_window=8 with model\.moe cannot be expressed by "
                                        r"transformers' OlmoeForCausalLM"):
        export_gpt(GPT(cfg), tokenizer_file, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key,value", [("logit_softcap", 30.0), ("norm", "layernorm"), ("mlp", "gelu")])
def test_export_refuses_a_variant_llama_cannot_express(tmp_path, tokenizer_file, key, value):
    cfg = dict(vocab_size=320, n_layers=1, d_model=64, n_heads=4, seq_len=32)
    with pytest.raises(DataError, match=rf"^model\.{key}=.*cannot be expressed by transformers' LlamaForCausalLM"):
        export_gpt(GPT(GPTConfig(**cfg, **{key: value})), tokenizer_file, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key,value", [("attention_sinks", True), ("attention_gate", "headwise"),
                                       ("qk_norm", False), ("qk_norm_scope", "projection")])
def test_export_refuses_sinks_and_a_gate_qwen3_next_lacks_naming_the_key(tmp_path, tokenizer_file, key, value):
    cfg = dict(vocab_size=320, n_layers=1, d_model=64, n_heads=4, seq_len=32, qk_norm=True,
               attention_gate="elementwise")
    with pytest.raises(DataError, match=rf"^model\.{key}=.*cannot be expressed by transformers'") as err:
        export_gpt(GPT(GPTConfig(**{**cfg, key: value})), tokenizer_file, tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_elementwise_gate_exports_as_qwen3_next_with_transformers_logits(tmp_path, tokenizer_file):
    """model.attention_gate=elementwise with per-head QK-norm -> Qwen3NextForCausalLM (lit_pretrain/interop/
    qwen3_next.py: gate rows interleaved into q_proj, zero-centred norms, whole-head RoPE, dense full-attention
    layers), grouped-query attention too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, qk_norm=True, d_ff=96,
                          seq_len=32, tie_embeddings=False, rope_theta=500.0, init_std=0.2,
                          attention_gate="elementwise")).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)  # a norm written without the zero-centring's minus 1 shows
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "Qwen3NextForCausalLM"
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        assert ours.abs().max() > 2
        # fp32 rounding only: the norms' (weight - 1) + 1 and the kernels' order; a gate row misplaced moves O(1)
        assert (theirs(idx).logits - ours).abs().max().item() <= 1e-5


def test_export_refuses_mup_logit_multiplier_and_accepts_it_at_the_base_width(tmp_path, tokenizer_file):
    cfg = dict(vocab_size=320, n_layers=1, d_model=64, n_heads=4, seq_len=32, init="mup")
    with pytest.raises(DataError, match=r"^model\.init=mup .* multiplies the logits by 0\.5"):
        export_gpt(GPT(GPTConfig(**cfg, mup_base_width=32)), tokenizer_file, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
    export_gpt(GPT(GPTConfig(**cfg, mup_base_width=64)), tokenizer_file, tmp_path / "hf")  # multiplier 1: exact


@pytest.mark.parametrize("key,value", [("num_key_value_heads", 3), ("attention_bias", True), ("mlp_bias", True),
                                       ("hidden_act", "gelu"), ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                       ("head_dim", 32)])
def test_import_refuses_a_llama_our_gpt_cannot_express(tmp_path, tokenizer_file, key, value):
    export_gpt(tiny_gpt(tied=True), tokenizer_file, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(DataError, match=rf"{key}(\.rope_type)?=.*cannot be expressed"):
        read_hf_config(tmp_path / "hf")


@pytest.mark.parametrize("key,value", [("first_k_dense_replace", 1), ("rope_interleave", True),
                                       ("kv_lora_rank", 0)])
def test_import_refuses_a_deepseek_v3_our_gpt_cannot_express(tmp_path, tokenizer_file, key, value):
    """Routed experts (DeepSeek-V3's grouped sigmoid router), interleaved RoPE, a rank that is not one."""
    cfg = GPTConfig(vocab_size=320, n_layers=2, d_model=64, n_heads=4, seq_len=32, attention="mla",
                    mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8})
    export_gpt(GPT(cfg), tokenizer_file, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(DataError, match=rf"{key}=.*cannot be expressed"):
        read_hf_config(tmp_path / "hf")


def test_import_of_another_architecture_is_one_line_exit_2(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                    "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300}))
    for args in ([str(EXPERIMENTS / "runs" / "tiny.yaml")], ["--out", str(tmp_path / "w.safetensors")]):
        assert cli.main(["import", str(folder), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err, err
    assert not (tmp_path / "w.safetensors").exists()


def test_export_never_writes_into_a_folder_that_holds_something(tmp_path, tokenizer_file):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not empty"):
        export_gpt(tiny_gpt(tied=True), tokenizer_file, tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine: it is replaced by the finished one
    export_gpt(tiny_gpt(tied=True), tokenizer_file, tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # no staging folder left


def test_init_from_must_compute_with_the_models_settings_and_tokenizer(tmp_path, tokenizer_file):
    export_gpt(tiny_gpt(tied=True), tokenizer_file, tmp_path / "hf")
    other = GPT(GPTConfig(**{**function_fields(tiny_gpt(tied=True).cfg), "seq_len": 32, "rope_theta": 10000.0}))
    with pytest.raises(ConfigError, match=r"model\.rope_theta=10000\.0 but run\.init_from .* has 500\.0"):
        load_init(other, tmp_path / "hf", tokenizer_file)
    another = tmp_path / "another.json"
    save_tokenizer(train_tokenizer(["some other text entirely\n"] * 20, 290), another)
    with pytest.raises(DataError, match="tokenizer of run.init_from .* differs"):
        load_init(tiny_gpt(tied=True), tmp_path / "hf", another)
    with pytest.raises(DataError, match="transformers' weight names: give its folder"):
        load_init(tiny_gpt(tied=True), tmp_path / "hf" / "model.safetensors", tokenizer_file)


@pytest.mark.slow
def test_trained_run_exports_loads_in_transformers_and_continues_training(tmp_path, tiny_data_dir):
    import lightning as L
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lit_pretrain.evaluation.generate import prompt_ids
    from lit_pretrain.train import train

    run_file = EXPERIMENTS / "runs" / "tiny.yaml"
    common = [*tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path / 'runs'}", "trainer.progress_bar=false"]

    class Float8Linears(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.names = [n for n, m in pl_module.model.named_modules() if type(m).__name__ == "Float8Linear"]

    # Trained with trainer.float8 (torchao, emulated on the CPU): the export is of plain weights all the same. The MFU's
    # peak is given, not measured: the bf16 1024² matmuls that measure it take ~15 s on a CPU without bf16 units.
    seen = Float8Linears()
    train(config.load(run_file, [*common, "trainer.max_steps=2", "schedule.warmup_steps=1",
                                 "trainer.precision=bf16-mixed", "trainer.float8={}",
                                 "callbacks.throughput.peak_flops_per_s=1e11"]), extra_callbacks=[seen])
    assert len(seen.names) == 2 * 7  # tiny: 2 blocks of 7 linears (d 64, MLP 192), all converted; not the head
    run_dir = tmp_path / "runs" / "tiny"
    assert cli.main(["export", str(run_dir / "checkpoints" / "last.ckpt"), "--to", "hf", str(tmp_path / "hf")]) == 0
    with pytest.raises(DataError, match="not empty"):  # a second export never overwrites the first
        export_run(run_dir, tmp_path / "hf")

    ours = load_tokenizer(tiny_data_dir / "tokenizer.json")
    text = "def f(x):\n    return x + 1\n"
    for tokenizer in (AutoTokenizer.from_pretrained(tmp_path / "hf"),
                      PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")):
        assert tokenizer.eos_token == EOD and tokenizer.eos_token_id == eod_id(ours)
        assert tokenizer(text).input_ids == prompt_ids(ours, eod_id(ours), text)  # generate's ids, EOD first
        assert tokenizer.decode(ours.encode(text).ids) == text
    model = load_gpt(run_dir)
    # FP8 is the run's trainer.float8, not part of the architecture: neither the model section nor the export holds it
    assert config.load(run_dir / "config.yaml").trainer.float8 is not None and not hasattr(model.cfg, "float8")
    assert "float8" not in (tmp_path / "hf" / "config.json").read_text()
    # The fp8-trained checkpoint holds the plain GPT's names and fp32 dtypes: it loads into a model without fp8.
    plain = GPT(model.cfg)
    dtypes = [(k, v.dtype) for k, v in model.state_dict().items()]
    assert dtypes == [(k, v.dtype) for k, v in plain.state_dict().items()]
    idx = torch.randint(0, model.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_model(tmp_path / "hf")(idx).logits - model(idx)).abs().max() <= 1e-5

    # Continued pretraining: one step at a rate far below fp32's resolution at these weights' size (|w| ~ 1e-2,
    # spacing ~1e-9) leaves them as imported, so the checkpoint shows exactly what the run started from.
    assert cli.main(["import", str(tmp_path / "hf"), str(run_file), *common, "run.name=continued",
                     "trainer.max_steps=1", "schedule.warmup_steps=0", "optim.lr_peak=1e-30", "schedule.lr_min=0",
                     "optim.weight_decay=0"]) == 0
    continued = tmp_path / "runs" / "continued"
    assert config.load(continued / "config.yaml").run.init_from == str((tmp_path / "hf").resolve())
    for name, tensor in load_gpt(continued).state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_mtp_modules_are_dropped_on_export_and_the_logits_are_the_main_heads(tmp_path, tokenizer_file):
    """model.mtp_depth's modules are trained only (lit_pretrain/model/mtp.py): none of their weights is written, and
    transformers' Llama computes our logits, which never read them."""
    from dataclasses import replace

    from safetensors.torch import load_file

    base = tiny_gpt(False)
    model = GPT(replace(base.cfg, mtp_depth=1)).eval()
    model.load_state_dict({**model.state_dict(), **base.state_dict()})
    assert any(name.startswith("mtp.0.block.") for name in model.state_dict())  # kept in our checkpoints
    export_gpt(model, tokenizer_file, tmp_path / "hf")
    assert sorted(load_file(tmp_path / "hf" / "model.safetensors")) == sorted(
        load_file(export_gpt(base, tokenizer_file, tmp_path / "plain") / "model.safetensors"))
    idx = torch.randint(0, 320, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf_model(tmp_path / "hf")(idx).logits - model(idx)).abs().max().item()
    assert diff <= 5e-5  # as test_logits_match_transformers_llama: fp32 rounding of the attention kernel only
