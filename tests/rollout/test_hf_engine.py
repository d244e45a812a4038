import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine

V = 96
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        head_dim=8,
        moe_intermediate_size=16,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen3_tied": lambda: Qwen3Config(**COMMON, head_dim=8, intermediate_size=48, tie_word_embeddings=True),
}
EXPERT_KEYS = {
    "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    "qwen2_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
}


def saved_reference(family, tmp_path):
    """A randomly initialized transformers model, saved with save_pretrained; returns (model, file tensors)."""
    torch.manual_seed(123)
    config = CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # make norms non-trivial so a missed tensor shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_buckets_in_random_order_reproduce_logits_bit_for_bit(family, tmp_path):
    model, tensors = saved_reference(family, tmp_path)
    if family in EXPERT_KEYS:
        assert EXPERT_KEYS[family] in tensors  # the on-disk layout keeps one tensor per expert
    engine = HFRolloutEngine(model.config, seed=7)
    assert sorted(engine.checkpoint_names()) == sorted(tensors)
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(engine.model(ids).logits, model(ids).logits)
    items = list(tensors.items())
    random.Random(0).shuffle(items)
    engine.begin_weight_update()
    for i in range(0, len(items), 3):
        engine.update_weights(items[i : i + 3])
    engine.end_weight_update()
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, model(ids).logits)
    sums = engine.weight_checksums(list(tensors))
    assert sums == {k: float(t.to(torch.float64).sum()) for k, t in tensors.items()}


def test_loading_from_a_directory(tmp_path):
    model, _ = saved_reference("mixtral", tmp_path)
    engine = HFRolloutEngine(tmp_path, weights=tmp_path)
    ids = torch.arange(20)[None] % V
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, model(ids).logits)


def test_loading_from_a_sharded_directory(tmp_path):
    """save_pretrained with a small max_shard_size: model.safetensors.index.json and several shards."""
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(CONFIGS["qwen3_moe"]()).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shards) >= 2, shards
    engine = HFRolloutEngine(tmp_path, weights=tmp_path, seed=9)
    ids = torch.arange(20)[None] % V
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, model(ids).logits)


def test_partial_expert_update_touches_only_its_slice(tmp_path):
    model, tensors = saved_reference("qwen3_moe", tmp_path)
    engine = HFRolloutEngine(model.config, weights=tensors)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new_up = torch.randn(16, 32)
    engine.update_weights([("model.layers.1.mlp.experts.2.up_proj.weight", new_up)])
    after = engine.model.state_dict()
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(after[fused][2, 16:], new_up)  # gate_up = cat(gate, up) along dim 1
    expected = before[fused].clone()
    expected[2, 16:] = new_up
    assert torch.equal(after[fused], expected)
    assert all(torch.equal(after[k], before[k]) for k in before if k != fused)
    checks = engine.weight_checksums(
        ["model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.2.gate_proj.weight"]
    )
    assert checks["model.layers.1.mlp.experts.2.up_proj.weight"] == float(new_up.double().sum())
    assert checks["model.layers.1.mlp.experts.2.gate_proj.weight"] == float(
        tensors["model.layers.1.mlp.experts.2.gate_proj.weight"].double().sum()
    )


@pytest.mark.parametrize(
    "name,tensor,error,match",
    [
        ("model.layers.0.mlp.experts.0.gate_up_proj", torch.zeros(4, 32, 32), KeyError, "unknown weight name"),
        ("model.layers.9.self_attn.q_proj.weight", torch.zeros(32, 32), KeyError, "unknown weight name"),
        ("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(16, 32), KeyError, "expert 4 out of range"),
        ("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(16, 32), ValueError, r"shape \(16, 32\)"),
    ],
)
def test_bad_weight_names_and_shapes_raise(name, tensor, error, match):
    engine = HFRolloutEngine(CONFIGS["qwen3_moe"]())
    with pytest.raises(error, match=match):
        engine.update_weights([(name, tensor)])


@pytest.fixture(scope="module")
def moe_engine():
    return HFRolloutEngine(CONFIGS["qwen3_moe"](), seed=3)


def teacher_forced_logits(engine, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        return engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]  # different lengths: left padding


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 5)])
def test_logprobs_equal_a_teacher_forced_forward(moe_engine, temperature, top_p, top_k):
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, stop_token_ids=[0, 1, 2], seed=11
    )
    groups = moe_engine.generate(PROMPTS, 3, params)
    assert [len(g) for g in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert s.prompt_ids == prompt and len(s.response_logprobs) == len(s.response_ids) >= 1
            if s.finish_reason == "stop":
                assert s.response_ids[-1] in (0, 1, 2) and not set(s.response_ids[:-1]) & {0, 1, 2}
            else:
                assert len(s.response_ids) == 12 and not set(s.response_ids) & {0, 1, 2}
            logits = teacher_forced_logits(moe_engine, prompt, s.response_ids) / temperature
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(s.response_logprobs), ref, atol=1e-5, rtol=0)
            for t, tok in enumerate(s.response_ids):  # the drawn token lies in the filtered set
                if top_k > 0:
                    assert tok in torch.topk(logits[t], top_k).indices.tolist()
                if top_p < 1.0:
                    probs, order = torch.softmax(logits[t], -1).sort(descending=True)
                    nucleus = order[: int((probs.cumsum(0) - probs < top_p).sum())].tolist()
                    assert tok in nucleus


def test_greedy_and_seeded_determinism(moe_engine):
    greedy = moe_engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=6))
    for prompt, group in zip(PROMPTS, greedy):
        assert group[0].response_ids == group[1].response_ids
        logits = teacher_forced_logits(moe_engine, prompt, group[0].response_ids)
        assert group[0].response_ids == logits.argmax(-1).tolist()
    params = SamplingParams(max_new_tokens=8, seed=5)
    a = moe_engine.generate(PROMPTS, 4, params)
    b = moe_engine.generate(PROMPTS, 4, params)
    c = moe_engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, seed=6))
    ids = lambda gs: [[s.response_ids for s in g] for g in gs]
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert [[s.response_logprobs for s in g] for g in a] == [[s.response_logprobs for s in g] for g in b]


def test_small_max_batch_size_gives_the_same_logprobs(moe_engine):
    small = HFRolloutEngine(CONFIGS["qwen3_moe"](), seed=3, max_batch_size=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    for g1, g2 in zip(moe_engine.generate(PROMPTS, 3, params), small.generate(PROMPTS, 3, params)):
        for s1, s2 in zip(g1, g2):
            assert s1.response_ids == s2.response_ids
            assert torch.allclose(torch.tensor(s1.response_logprobs), torch.tensor(s2.response_logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "params,n,match",
    [
        (SamplingParams(temperature=-1.0), 1, "temperature"),
        (SamplingParams(top_p=0.0), 1, "top_p"),
        (SamplingParams(top_k=0), 1, "top_k"),
        (SamplingParams(max_new_tokens=0), 1, "max_new_tokens"),
        (SamplingParams(), 0, "n"),
    ],
)
def test_bad_sampling_params(moe_engine, params, n, match):
    with pytest.raises(ValueError, match=match):
        moe_engine.generate([[1, 2]], n, params)


def test_config_forms():
    config = CONFIGS["qwen3_moe"]()
    engine = HFRolloutEngine(config.to_dict(), seed=3)
    assert type(engine.config) is type(config) and engine.config.num_experts == 4
    with pytest.raises(ValueError, match="model_type"):
        HFRolloutEngine({"hidden_size": 8})
    with pytest.raises(TypeError, match="config must be"):
        HFRolloutEngine(3)
