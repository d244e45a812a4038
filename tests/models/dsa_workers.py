"""Rank functions for tests/models/test_deepseek_v32.py and test_glm_moe_dsa.py (module level: spawned ranks import them)."""

from __future__ import annotations


def score_with_and_without_selection(rank: int, world: int, hf_dir: str, ckpt: str, rows: list) -> dict:
    """One rank: convert ``hf_dir``, score ``rows`` as built, then with the indexer's selection dropped
    (every causal key kept: dense MLA). Returns the log-probs of both and how many (query, key) pairs
    within causality the selection masked in the first scoring."""
    import torch

    from gspo_megatron import convert
    from gspo_megatron.models.deepseek_v32 import indexer as dsa
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    init_distributed(ParallelLayout())
    convert.hf_to_megatron(hf_dir, ckpt)
    model, _ = convert.load_model(ckpt)
    select, masked = dsa.LightningIndexer.select, []

    def counting(self, x, qr, *args, **kwargs):
        keep = select(self, x, qr, *args, **kwargs)
        n = keep.shape[0]
        masked.append(int(torch.ones(n, n, dtype=torch.bool).tril().sum() - keep.sum()))
        return keep

    def dense(self, x, qr, *args, **kwargs):
        n = x.shape[0]
        return torch.ones(n, n, dtype=torch.bool, device=x.device).tril()

    dsa.LightningIndexer.select = counting
    try:
        sparse = score_rows(model, rows, micro_batch_size=1)
        dsa.LightningIndexer.select = dense
        full = score_rows(model, rows, micro_batch_size=1)
    finally:
        dsa.LightningIndexer.select = select
    destroy_distributed()
    return {"sparse": sparse, "dense": full, "masked_pairs": sum(masked)}


def indexer_vs_transformers(rank: int, world: int, hf_cfg: dict, n: int, interleaved: bool | None = None) -> dict:
    """One rank: transformers' indexer of ``hf_cfg``'s model type (``DeepseekV32Indexer`` /
    ``GlmMoeDsaIndexer``) and ours (``LightningIndexer``; ``interleaved``: force its RoPE style, None: the
    family's) with the same random weights on one random sequence of ``n`` tokens. Returns whether the
    selections (within causality) are equal, how many rows have a tie at the k-th place, and on how many
    of those the rule "earliest key wins" would have chosen otherwise."""
    import torch

    from gspo_megatron.models import get_family
    from gspo_megatron.models.deepseek_v32.indexer import InterleavedLightningIndexer, LightningIndexer

    if hf_cfg["model_type"] == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer as DeepseekV32Indexer
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaRotaryEmbedding as DeepseekV32RotaryEmbedding,
        )
    else:
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32Indexer,
            DeepseekV32RotaryEmbedding,
        )
    from gspo_megatron.models.tiny import hf_model_from_config
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout())
    family = get_family(hf_cfg)
    if interleaved is None:
        interleaved = hf_cfg["model_type"] == "glm_moe_dsa"
    cls = InterleavedLightningIndexer if interleaved else LightningIndexer
    ours = cls(family.megatron_config_class()(**family.config_fields(hf_cfg)))
    config = hf_model_from_config(hf_cfg).config
    ref = DeepseekV32Indexer(config, 0).eval()
    g = torch.Generator().manual_seed(0)
    pairs = {
        "wq_b.weight": "linear_wq_b.weight",
        "wk.weight": "linear_wk.weight",
        "k_norm.weight": "k_norm.weight",
        "k_norm.bias": "k_norm.bias",
        "weights_proj.weight": "linear_weights_proj.weight",
    }
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            mine[pairs[name]].copy_(p)
    topk, d = hf_cfg["index_topk"], hf_cfg["index_head_dim"]
    x, qr = torch.randn(1, n, hf_cfg["hidden_size"], generator=g), torch.randn(1, n, hf_cfg["q_lora_rank"], generator=g)
    pos = torch.arange(n)[None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    idx = ref(x, qr, DeepseekV32RotaryEmbedding(config)(x, pos), causal[None], pos)[0]
    want = torch.zeros(n, n, dtype=torch.bool).scatter_(-1, idx.long(), True) & causal
    got = ours.select(x[0], qr[0])
    # the scores, to find the rows with a tie at the k-th place
    cos, sin = ours._cos_sin(n, "cpu")
    q = ours._rope(ours.linear_wq_b(qr[0]).view(n, ours.n_heads, d), cos, sin)
    k = ours._rope(ours.k_norm(ours.linear_wk(x[0])), cos, sin)
    w = ours.linear_weights_proj(x[0]) * ours.n_heads**-0.5
    score = (torch.relu(torch.einsum("shd,td->sht", q, k) * d**-0.5) * w[..., None]).sum(1)
    score = score.masked_fill(~causal, float("-inf"))
    tied_rows = earliest_differs = 0
    for s in range(topk, n):
        kth = score[s].topk(topk).values[-1]
        above, tied = score[s] > kth, score[s] == kth
        if int(above.sum() + tied.sum()) > topk:
            tied_rows += 1
            earliest = above | (tied & (tied.cumsum(0) <= topk - int(above.sum())))
            earliest_differs += int(not torch.equal(earliest, got[s]))
    destroy_distributed()
    return {"equal": bool(torch.equal(got, want)), "tied_rows": tied_rows, "earliest_differs": earliest_differs}


def shared_layer_selections(rank: int, world: int, hf_dir: str, ckpt: str, rows: list) -> dict:
    """One rank, a checkpoint with "shared" indexer layers: convert ``hf_dir``, score ``rows`` (one per
    micro-batch) recording the selection each layer's core attention attends with; score again with
    every shared layer's carried selection replaced by the causal mask (reuse dropped); export the
    weight-sync stream and load it into sglang's own class (``cpu_server/sglang_models.SglangModel``).
    Returns the log-probs of both scorings, per row whether each shared layer's selection is the very
    tensor of the full layer it reuses (and differs from the next full layer's), the layers built
    without an indexer on both sides, the streamed names and sglang's unwritten parameters."""
    import torch

    from gspo_megatron import convert
    from gspo_megatron.cpu_server.sglang_models import SglangModel
    from gspo_megatron.models.deepseek_v32 import indexer as dsa
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    init_distributed(ParallelLayout())
    convert.hf_to_megatron(hf_dir, ckpt)
    model, _ = convert.load_model(ckpt)
    attend, take, seen = dsa.DSALocalAttention._attend, dsa.SelectionCarry.take, []

    def recording(self, query, key, value, selection, *args):
        seen.append((self.layer_number - 1, selection))
        return attend(self, query, key, value, selection, *args)

    def dropped(self, att, key):
        sel = take(self, att, key)
        return torch.ones_like(sel).tril_()  # padded micro-batches (score_rows): keep [b, s, s]

    dsa.DSALocalAttention._attend = recording
    try:
        reused = score_rows(model, rows, micro_batch_size=1)
        dsa.SelectionCarry.take = dropped
        no_reuse = score_rows(model, rows, micro_batch_size=1)
    finally:
        dsa.DSALocalAttention._attend, dsa.SelectionCarry.take = attend, take
    types = model.config.dsa_indexer_types
    n = len(types)
    per_row = [dict(seen[i : i + n]) for i in range(0, len(rows) * n, n)]  # the first scoring's rows
    is_source, differs_from_next = [], []
    for sel in per_row:
        for layer, t in enumerate(types):
            if t == "shared":
                src = max(i for i in range(layer) if types[i] == "full")
                is_source.append(sel[layer] is sel[src])
                later = [i for i in range(layer, n) if types[i] == "full"]
                if later:
                    differs_from_next.append(not torch.equal(sel[layer], sel[later[0]]))
    no_indexer = [
        i for i, layer in enumerate(model.decoder.layers) if layer.self_attention.core_attention.indexer is None
    ]
    buckets = [[(k, t.clone()) for k, t in b] for b in export_hf_weights(model, 48 << 10)]
    sg = SglangModel(hf_dir, 1, 0, dtype=torch.float32)
    sg.poison()
    for bucket in buckets:
        sg.load(bucket)
    sg_no_indexer = [i for i, layer in enumerate(sg.model.model.layers) if layer.self_attn.indexer is None]
    destroy_distributed()
    return {
        "reused": reused,
        "no_reuse": no_reuse,
        "is_source": is_source,
        "differs_from_next": differs_from_next,
        "no_indexer": no_indexer,
        "sglang_no_indexer": sg_no_indexer,
        "streamed": {k: t for b in buckets for k, t in b},
        "unwritten": sg.unwritten(),
    }
