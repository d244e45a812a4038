"""The CPU server's SGLang sharding rules (no server started) and its command line."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from gspo_megatron.cpu_server import expected_shard
from gspo_megatron.cpu_server.args import parse_args
from gspo_megatron.cpu_server.sharding import Layout, assemble, kind_of, owner_ranks, shard_for_rank
from gspo_megatron.cpu_server.weights import checkpoint_shapes
from gspo_megatron.models.tiny import save_tiny_hf_model

CFG = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64, vocab_size=100, num_experts=4)


def test_column_row_and_kv_replication_by_hand():
    q = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    # q_proj: 4 heads of 16 rows, tp 2 -> rank 1 has rows 32..63
    assert torch.equal(expected_shard("model.layers.0.self_attn.q_proj.weight", q, 1, 2, 1, CFG), q[32:])
    # o_proj is row parallel: columns
    assert torch.equal(expected_shard("model.layers.0.self_attn.o_proj.weight", q, 1, 2, 1, CFG), q[:, 32:])
    k = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64)  # 2 kv heads x 16
    # tp 2 == kv heads: one head each
    assert torch.equal(expected_shard("model.layers.0.self_attn.k_proj.weight", k, 1, 2, 1, CFG), k[16:])
    # tp 4 > 2 kv heads: ranks 0,1 replicate head 0, ranks 2,3 head 1 (sglang QKVParallelLinear)
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        got = expected_shard("model.layers.0.self_attn.v_proj.weight", k, rank, 4, 1, CFG)
        assert torch.equal(got, k[16 * head : 16 * (head + 1)]), rank
    assert owner_ranks("model.layers.0.self_attn.k_proj.weight", Layout.from_config(CFG, 4, 1)) == [0, 2]
    norm = torch.randn(16)
    assert torch.equal(expected_shard("model.layers.0.self_attn.q_norm.weight", norm, 3, 4, 1, CFG), norm)
    router = torch.randn(4, 64)
    assert torch.equal(expected_shard("model.layers.0.mlp.gate.weight", router, 1, 2, 1, CFG), router)


def test_vocab_padding_by_hand():
    emb = torch.randn(100, 64)  # padded to 128: 64 rows per rank at tp 2
    r0 = expected_shard("model.embed_tokens.weight", emb, 0, 2, 1, CFG)
    r1 = expected_shard("lm_head.weight", emb, 1, 2, 1, CFG)
    assert r0.shape == (64, 64) and torch.equal(r0, emb[:64])
    assert r1.shape == (64, 64) and torch.equal(r1[:36], emb[64:]) and not r1[36:].any()
    assert torch.equal(assemble("lm_head.weight", [r0, r1], Layout.from_config(CFG, 2, 1), (100, 64)), emb)


def test_experts_tp_and_ep_by_hand():
    up = torch.randn(32, 64)
    down = torch.randn(64, 32)
    name_up, name_down = "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"
    # ep 1, tp 2: every rank has every expert, intermediate halves
    assert torch.equal(expected_shard(name_up, up, 1, 2, 1, CFG), up[16:])
    assert torch.equal(expected_shard(name_down, down, 1, 2, 1, CFG), down[:, 16:])
    # ep 2 == tp 2: rank 0 experts 0-1, rank 1 experts 2-3, whole
    assert expected_shard(name_up, up, 0, 2, 2, CFG) is None
    assert torch.equal(expected_shard(name_up, up, 1, 2, 2, CFG), up)
    # mixtral naming, tp 4 ep 2: moe_tp 2; expert 3 on ranks 2 (first half) and 3
    w2 = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    assert kind_of(w2) == "expert"
    assert torch.equal(expected_shard(w2, down, 2, 4, 2, CFG), down[:, :16])
    assert expected_shard(w2, down, 1, 4, 2, CFG) is None
    assert owner_ranks(w2, Layout.from_config(CFG, 4, 2)) == [2, 3]


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "qwen2", "qwen3", "gpt_oss", "deepseek_v3", "glm4_moe", "minimax_m2"]
)
def test_every_checkpoint_name_shards_and_reassembles(family, tmp_path):
    """Names known to the server == the names transformers saves (tied lm_head aside); for tp 1, 2,
    4 (and ep 2) every tensor's owner shards put back together give the tensor."""
    save_tiny_hf_model(family, str(tmp_path))
    config = AutoConfig.from_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    shapes = checkpoint_shapes(config)
    expected_names = set(saved) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(shapes) == expected_names
    for tp, ep in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2)):
        layout = Layout.from_config(config, tp, ep)
        layout.check()
        for name in expected_names:
            full = saved[name]
            shards = [shard_for_rank(name, full, r, layout) for r in range(tp)]
            owners = owner_ranks(name, layout)
            assert all(shards[r] is not None for r in owners), (name, tp, ep)
            assert torch.equal(assemble(name, [shards[r] for r in owners], layout, full.shape), full), (name, tp, ep)


def test_cli_refuses_like_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "x", "--no-such-flag", "1"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--tp-size", "2", "--nnodes", "2"])  # no --dist-init-addr
    a = parse_args(
        [
            "--model-path",
            "x",
            "--tp-size",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "127.0.0.1:5000",
            "--base-gpu-id",
            "3",
            "--mem-fraction-static",
            "0.5",
            "--enable-memory-saver",
            "--skip-server-warmup",
            "--load-format",
            "dummy",
        ]
    )
    assert a.local_tp_ranks() == [2, 3] and a.mem_fraction_static == 0.5 and a.load_format == "dummy"


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "mixtral", "qwen3_moe"])
def test_layout_reads_every_expert_count_spelling_from_a_dict(family):
    """A config.json dict (models.hf_config.load_hf_config) names the expert count n_routed_experts
    (DeepSeek / GLM), num_local_experts (Mixtral) or num_experts: each gives the family's count."""
    from gspo_megatron.models.hf_config import num_experts
    from tiny_models import tiny_hf_config

    hf = tiny_hf_config(family)
    assert Layout.from_config(hf, 2, 2).num_experts == num_experts(hf) > 0
