"""The weight-sync stream loaded by sglang 0.5.23's own model classes (issue 21: the faithful twin).

For Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5, gpt-oss, MiniMax-M2, Qwen3-Next, DeepSeek-V3.2
and GLM-5 (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``, built on CPU with only its GPU capability
probe answered: ``sglang_models.gpu_capability_stand_in``), Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``) and
its vision-language checkpoint (``Qwen3_5MoeForConditionalGeneration``: the stream holds
``model.language_model.*`` + ``lm_head``; every sglang parameter but the vision tower, which the engine
keeps from start-up, is written) (tiny random checkpoints that
transformers wrote): a Megatron model loaded from the checkpoint exports its weights through the
stream the weight sync sends (``models.weights.export_hf_weights``, small buckets), and each bucket
goes to sglang's class (``cpu_server/sglang_models.py``: one ``load_weights`` call per bucket, as
sglang's weight updater) at engine TP 1 and at engine TP 2 (two gloo ranks). Every sglang parameter
must be written (NaN-poisoned before the sync) and equal an independent reference built here from
the checkpoint's tensors by sglang's layout: ``qkv_proj = cat(q, k, v)`` shards (K/V heads
replicated when tp > kv heads), ``gate_up_proj = cat(gate, up)`` shards, experts ``w13 = cat(w1, w3)``
and ``w2`` per expert, DeepSeek's ``fused_qkv_a_proj_with_mqa = cat(q_a_proj, kv_a_proj_with_mqa)``,
gpt-oss's stacked experts transposed (``gate_up_proj`` interleaved, sliced whole; ``down_proj_bias``
on MoE TP rank 0 only), sinks by head, MiniMax-M2's full-width ``q_norm`` / ``k_norm`` by head
(``MiniMaxM2RMSNormTP``), DeepSeek-V3.2's indexer replicated (``weights_proj`` held in bfloat16, as
sglang builds it); on CUDA sglang fuses the indexer's ``wk`` + ``weights_proj`` into one bfloat16
``wk_weights_proj`` as each arrives: its own ``_load_fused_indexer_wk`` is fed the streamed tensors too.

Negative evidence (defect 2): DeepSeek buckets cut between ``q_a_proj`` and ``kv_a_proj_with_mqa``
(as the export sorted by name used to cut them) leave ``fused_qkv_a_proj_with_mqa`` unwritten, and the
check names it; a Qwen2-MoE with ``mlp_only_layers`` leaves that layer's MLP unwritten (defect 10).

Two spawned runs serve every case: one rank (export + engine TP 1) and two ranks (engine TP 2).
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

pytest.importorskip("sglang")

FAMILIES = {  # tiny config overrides
    "qwen3_moe": {},
    "qwen2_moe": {"mlp_only_layers": []},  # sglang builds every Qwen2-MoE layer sparse (see the last test)
    "mixtral": {},
    "deepseek_v3": {},
    "glm4_moe": {},
    "gpt_oss": {},
    "minimax_m2": {},
    "qwen3_next": {},
    "deepseek_v32": {},
    "glm_moe_dsa": {},
    "qwen3_5_moe": {},
    # the published vision-language layout: language model under model.language_model., vision tower carried
    "qwen3_5_moe_vl": {"architectures": ["Qwen3_5MoeForConditionalGeneration"]},
}
FAMILY_OF = {"qwen3_5_moe_vl": "qwen3_5_moe"}  # FAMILIES keys that are variants of a family
BUCKET_BYTES = 48 << 10  # many buckets per model: the per-bucket call granularity matters
SPLIT_LAYER = 2  # the DeepSeek layer whose q_a / kv_a pair the negative case splits


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    return dict(iter_checkpoint(hf_dir))


def _load_into_sglang(hf_dir, tp, rank, buckets):
    from gspo_megatron.cpu_server.sglang_models import SglangModel

    m = SglangModel(hf_dir, tp, rank, dtype=torch.float32)
    m.poison()
    kept = sorted(n for n in m.params() if n not in m.synced_params())  # never sent: must stay as they were
    with torch.no_grad():
        for n in kept:
            m.params()[n].fill_(7.0)
    for bucket in buckets:
        m.load([(n, t.clone()) for n, t in bucket])  # sglang may write into what it is given (gpt-oss)
    m.kept_report = dict(names=kept, changed=[n for n in kept if not bool((m.params()[n] == 7.0).all())])
    return m


def _tp1_run(rank, world, dirs: dict, negative: dict):
    """Export each family through the weight stream, load it into sglang's class at TP 1."""
    from gspo_megatron import convert
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    out = {}
    for kind, hf_dir in dirs.items():
        init_distributed(ParallelLayout())
        model, _ = convert.load_model(hf_dir)
        buckets = [[(n, t.clone()) for n, t in b] for b in export_hf_weights(model, BUCKET_BYTES)]
        del model
        m = _load_into_sglang(hf_dir, 1, 0, buckets)
        out[kind] = dict(
            buckets=buckets,
            unwritten=m.unwritten(),
            kept=m.kept_report,
            params={n: p.detach().clone() for n, p in m.params().items()},
        )
        if kind == "deepseek_v32":
            out["dsa_cuda_fused"] = _cuda_fused_indexer(buckets, m)
        if kind == "qwen3_5_moe_vl":
            out["vl_spellings"] = _vl_spellings(hf_dir, buckets)
    for case, (hf_dir, buckets) in negative.items():
        m = _load_into_sglang(hf_dir, 1, 0, buckets)
        try:
            m.check_written()
            error = None
        except RuntimeError as e:
            error = str(e)
        out[case] = dict(unwritten=m.unwritten(), error=error)
    return out


def _vl_spellings(hf_dir, buckets) -> dict:
    """What sglang's ``Qwen3_5MoeForConditionalGeneration.load_weights`` does with the other names the CPU
    server's store takes or skips (``cpu_server/weights.py``): the stream with ``model.*`` for
    ``model.language_model.*``; a vision-tower tensor (loaded into ``visual.*``); an ``mtp.*`` tensor; a
    wrong shape (the exception's type)."""
    bare = [[(n.replace("model.language_model.", "model.", 1), t) for n, t in b] for b in buckets]
    m = _load_into_sglang(hf_dir, 1, 0, bare)
    params = {n: p.detach().clone() for n, p in m.params().items()}
    hf = _hf_tensors(hf_dir)
    vision = "model.visual.blocks.0.norm1.weight"
    m.load([(vision, hf[vision] + 1.0), ("mtp.fc.weight", torch.zeros(8, 64))])
    vision_loaded = torch.equal(m.params()["visual.blocks.0.norm1.weight"], hf[vision] + 1.0)
    try:
        m.load([("model.language_model.norm.weight", torch.ones(3))])
        wrong_shape = None
    except Exception as e:  # noqa: BLE001 - whatever sglang's weight loader raises
        wrong_shape = type(e).__name__
    return dict(unwritten=m.unwritten(), params=params, vision_loaded=vision_loaded, wrong_shape=wrong_shape)


def _cuda_fused_indexer(buckets, m) -> dict:
    """sglang's CUDA layout of the indexer (``dsa_indexer.py``: ``wk_weights_proj`` [head_dim + n_heads,
    hidden] bfloat16, built only on CUDA): its loader helper ``_load_fused_indexer_wk`` fed every streamed
    ``indexer.wk`` / ``indexer.weights_proj`` tensor, one at a time and in stream order, into NaN params.
    Returns the fused params and whether the helper consumed every tensor."""
    from sglang.srt.models.deepseek_common.deepseek_weight_loader import _load_fused_indexer_wk

    params, consumed = {}, True
    for bucket in buckets:
        for name, t in bucket:
            if ".indexer.wk." in name or ".indexer.weights_proj." in name:
                fused = name.rsplit(".indexer.", 1)[0] + ".indexer.wk_weights_proj.weight"
                rows = m.model.config.index_head_dim + m.model.config.index_n_heads
                params.setdefault(fused, torch.full((rows, t.shape[1]), float("nan"), dtype=torch.bfloat16))
                consumed &= _load_fused_indexer_wk(name, t.clone(), params, {}, None)
    return dict(params=params, consumed=consumed)


def _tp2_run(rank, world, jobs: dict):
    out = {}
    for kind, (hf_dir, buckets) in jobs.items():
        m = _load_into_sglang(hf_dir, world, rank, buckets)
        out[kind] = dict(
            unwritten=m.unwritten(), kept=m.kept_report, params={n: p.detach().clone() for n, p in m.params().items()}
        )
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    out = {}
    for kind, overrides in FAMILIES.items():
        d = tmp_path_factory.mktemp(kind)
        save_tiny_hf_model(FAMILY_OF.get(kind, kind), str(d), **overrides)
        out[kind] = str(d)
    d = tmp_path_factory.mktemp("qwen2_moe_dense_layer")
    save_tiny_hf_model("qwen2_moe", str(d), mlp_only_layers=[1])
    out["qwen2_moe_dense_layer"] = str(d)
    return out


def _split_deepseek(hf: dict) -> list[list]:
    """Name-sorted buckets (the export's order before fuse groups) cut right after layer
    SPLIT_LAYER's kv_a_proj_with_mqa: its kv_b_proj, o_proj, q_a_proj ... land in the next one."""
    items = sorted(hf.items())
    cut = (
        next(
            i
            for i, (n, _) in enumerate(items)
            if n == f"model.layers.{SPLIT_LAYER}.self_attn.kv_a_proj_with_mqa.weight"
        )
        + 1
    )
    return [items[:cut], items[cut:]]


@pytest.fixture(scope="module")
def runs(dirs):
    main = {k: v for k, v in dirs.items() if k in FAMILIES}
    negative = {
        "deepseek_split": (dirs["deepseek_v3"], _split_deepseek(_hf_tensors(dirs["deepseek_v3"]))),
        "qwen2_moe_dense_layer": (
            dirs["qwen2_moe_dense_layer"],
            [sorted(_hf_tensors(dirs["qwen2_moe_dense_layer"]).items())],
        ),
    }
    tp1 = run_ranks(_tp1_run, 1, main, negative, timeout=900)[0]
    jobs = {k: (main[k], tp1[k]["buckets"]) for k in FAMILIES}
    tp2 = run_ranks(_tp2_run, 2, jobs, timeout=900)
    return {1: [tp1], 2: tp2}


# -- the independent reference: sglang's layout from the checkpoint's tensors --------------------------


def _chunk(t, dim, parts, idx):
    assert t.shape[dim] % parts == 0, (t.shape, dim, parts)
    n = t.shape[dim] // parts
    return t.narrow(dim, idx * n, n)


def reference(name: str, hf: dict, cfg: dict, tp: int, rank: int) -> torch.Tensor:
    """What sglang 0.5.23 holds in parameter ``name`` on engine TP rank ``rank`` (moe_tp = tp, ep 1)."""
    col = lambda t: _chunk(t, 0, tp, rank)
    row = lambda t: _chunk(t, 1, tp, rank)
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or heads

    def kv(t):
        return _chunk(t, 0, kvh, rank // (tp // kvh)) if tp >= kvh else col(t)

    if cfg.get("model_type") in ("qwen3_next", "qwen3_5_moe_text"):
        got = _qwen3_next_reference(name, hf, cfg, col, row, kv)
        if got is not None:
            return got
    base, _, leaf = name.rpartition(".")
    if base.endswith(".qkv_proj"):
        p = base[: -len("qkv_proj")]
        return torch.cat([col(hf[f"{p}q_proj.{leaf}"]), kv(hf[f"{p}k_proj.{leaf}"]), kv(hf[f"{p}v_proj.{leaf}"])])
    if base.endswith(".fused_qkv_a_proj_with_mqa"):
        p = base[: -len("fused_qkv_a_proj_with_mqa")]
        return torch.cat([hf[f"{p}q_a_proj.weight"], hf[f"{p}kv_a_proj_with_mqa.weight"]])
    if base.endswith(".gate_up_proj"):  # dense MLP and shared experts (MergedColumnParallelLinear)
        p = base[: -len("gate_up_proj")]
        return torch.cat([col(hf[f"{p}gate_proj.weight"]), col(hf[f"{p}up_proj.weight"])])
    if ".experts.w" in name:
        return _experts_reference(name, hf, cfg, tp, rank)
    if cfg.get("model_type") == "minimax_m2" and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        # MiniMaxM2RMSNormTP: the full-width norm's weight split with its heads (k: like k_proj)
        return col(hf[name]) if ".q_norm." in name else kv(hf[name])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return row(hf[name])
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "self_attn.sinks")) or name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        return col(hf[name])  # (tiny vocabularies are multiples of sglang's padding, 64)
    return hf[name]  # replicated: norms, routers, o_proj bias, e_score_correction_bias


def _qwen3_next_reference(name, hf, cfg, col, row, kv):
    """sglang's Qwen3-Next: attention parameters without ``self_attn.`` (q_proj rows [query | gate] per head,
    sliced by heads like q); Gated DeltaNet ``in_proj_qkvz`` / ``in_proj_ba`` sliced contiguously (their
    rows are grouped per key head), ``conv1d`` sliced per q / k / v part (mamba_v2_sharded_weight_loader)."""
    layer, _, rest = name.partition(".layers.")
    idx, _, leaf = rest.partition(".")
    attn = f"model.layers.{idx}.self_attn."
    if leaf in ("qkv_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight"):
        if leaf == "qkv_proj.weight":
            return torch.cat(
                [col(hf[attn + "q_proj.weight"]), kv(hf[attn + "k_proj.weight"]), kv(hf[attn + "v_proj.weight"])]
            )
        return row(hf[attn + leaf]) if leaf == "o_proj.weight" else hf[attn + leaf]
    if ".linear_attn." not in name:
        return None
    qk = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    p = name.rsplit(".", 2)[0] + "."
    if name.endswith("in_proj_qkvz.weight") and p + "in_proj_qkv.weight" in hf:  # Qwen3.5: four tensors
        q, k, v = torch.split(hf[p + "in_proj_qkv.weight"], [qk, qk, hf[p + "in_proj_qkv.weight"].shape[0] - 2 * qk])
        return torch.cat([col(q), col(k), col(v), col(hf[p + "in_proj_z.weight"])])
    if name.endswith("in_proj_ba.weight") and p + "in_proj_b.weight" in hf:
        return torch.cat([col(hf[p + "in_proj_b.weight"]), col(hf[p + "in_proj_a.weight"])])
    if name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log")):
        return col(hf[name])
    if name.endswith("conv1d.weight"):
        return torch.cat([col(t) for t in torch.split(hf[name], [qk, qk, hf[name].shape[0] - 2 * qk])])
    if name.endswith("out_proj.weight"):
        return row(hf[name])
    return hf[name]


def _experts_reference(name, hf, cfg, tp, rank):
    block, _, leaf = name.partition(".experts.")
    num = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if f"{block}.experts.gate_up_proj" in hf:  # gpt-oss: stacked [E, H, 2I] (gate / up interleaved)
        gu, down = hf[f"{block}.experts.gate_up_proj"], hf[f"{block}.experts.down_proj"]
        if leaf == "w13_weight":
            return _chunk(gu.transpose(1, 2), 1, tp, rank)
        if leaf == "w13_weight_bias":
            return _chunk(hf[f"{block}.experts.gate_up_proj_bias"], 1, tp, rank)
        if leaf == "w2_weight":
            return _chunk(down.transpose(1, 2), 2, tp, rank)
        bias = hf[f"{block}.experts.down_proj_bias"]  # w2_weight_bias: added once, by MoE TP rank 0
        return bias if rank == 0 else torch.zeros_like(bias)
    gate, up, down = (
        ("w1", "w3", "w2") if f"{block}.experts.0.w1.weight" in hf else ("gate_proj", "up_proj", "down_proj")
    )
    if leaf == "w13_weight":
        return torch.stack(
            [
                torch.cat(
                    [
                        _chunk(hf[f"{block}.experts.{e}.{gate}.weight"], 0, tp, rank),
                        _chunk(hf[f"{block}.experts.{e}.{up}.weight"], 0, tp, rank),
                    ]
                )
                for e in range(num)
            ]
        )
    assert leaf == "w2_weight", name
    return torch.stack([_chunk(hf[f"{block}.experts.{e}.{down}.weight"], 1, tp, rank) for e in range(num)])


def _language_model_view(hf: dict, cfg: dict):
    """A vision-language checkpoint (``text_config``) as the weight sync sees it: its tensors but the
    carried vision tower (``model.visual.*``), and the text config. Returns (tensors, config, vision names)."""
    if "text_config" not in cfg:
        return hf, cfg, set()
    vision = {n for n in hf if n.startswith("model.visual.")}
    return {n: t for n, t in hf.items() if n not in vision}, dict(cfg["text_config"]), vision


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_sync_stream_loads_every_sglang_param_exactly(runs, dirs, kind, tp):
    import json

    hf = _hf_tensors(dirs[kind])
    with open(f"{dirs[kind]}/config.json") as f:
        cfg = json.load(f)
    streamed = {n: t for b in runs[1][0][kind]["buckets"] for n, t in b}
    hf, cfg, vision = _language_model_view(hf, cfg)
    # the trainer's weights as streamed are the checkpoint's (so the reference is the trainer's too)
    assert streamed.keys() == hf.keys()
    assert all(torch.equal(streamed[n], hf[n]) for n in hf)
    assert len(runs[1][0][kind]["buckets"]) > 3
    hf = {n.replace("model.language_model.", "model.", 1): t for n, t in hf.items()}  # as sglang's load_weights
    for rank, res in enumerate(runs[tp]):
        r = res[kind]
        assert r["unwritten"] == [], (kind, tp, rank, r["unwritten"])
        # a vision tower is never sent: the engine keeps the one it loaded at start-up (all of it, only it)
        assert r["kept"]["names"] == sorted(n for n in r["params"] if vision and n.startswith("visual.")), kind
        assert bool(vision) == bool(r["kept"]["names"]) and r["kept"]["changed"] == [], (kind, r["kept"])
        assert r["params"], kind
        for name, got in r["params"].items():
            if name.startswith("visual."):
                continue
            want = reference(name, hf, cfg, tp, rank).to(got.dtype)
            assert got.shape == want.shape, (kind, tp, rank, name, got.shape, want.shape)
            assert torch.equal(got, want), (kind, tp, rank, name)


def test_vl_class_takes_both_language_model_spellings(runs):
    """sglang's ``Qwen3_5MoeForConditionalGeneration.load_weights`` rewrites ``model.language_model.`` to
    ``model.``: the stream spelled ``model.*`` writes every parameter alike (the CPU server's store and the
    transformers engine take both spellings too); a vision-tower name loads into ``visual.*`` (the store
    skips it: its generation is text only); a wrong shape raises (the store raises too)."""
    r, streamed = runs[1][0]["vl_spellings"], runs[1][0]["qwen3_5_moe_vl"]["params"]
    assert r["unwritten"] == [] and r["params"].keys() == streamed.keys()
    assert all(torch.equal(r["params"][n], t) for n, t in streamed.items() if not n.startswith("visual."))
    assert r["vision_loaded"] and r["wrong_shape"] is not None, r


def test_deepseek_v32_indexer_loads_into_sglangs_cuda_fused_layout(runs, dirs):
    r, hf = runs[1][0]["dsa_cuda_fused"], _hf_tensors(dirs["deepseek_v32"])
    assert r["consumed"] and len(r["params"]) == sum(1 for n in hf if n.endswith("indexer.wk.weight"))
    for fused, got in r["params"].items():
        p = fused.removesuffix("wk_weights_proj.weight")
        want = torch.cat([hf[f"{p}wk.weight"], hf[f"{p}weights_proj.weight"]]).to(torch.bfloat16)
        assert torch.equal(got, want), fused


def test_deepseek_split_pair_leaves_fused_qkv_a_unwritten_and_the_check_names_it(runs):
    """Defect 2 on sglang's own loader: a bucket boundary between q_a_proj and kv_a_proj_with_mqa."""
    r = runs[1][0]["deepseek_split"]
    fused = f"model.layers.{SPLIT_LAYER}.self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert r["unwritten"] == [fused]
    assert r["error"] is not None and fused in r["error"] and "unwritten" in r["error"]


def test_qwen2_moe_mlp_only_layers_are_unwritten_by_sglang(runs):
    """Defect 10: sglang's Qwen2-MoE builds every layer sparse; a dense layer's MLP is never loaded."""
    r = runs[1][0]["qwen2_moe_dense_layer"]
    assert r["unwritten"] and all(n.startswith("model.layers.1.mlp.") for n in r["unwritten"]), r["unwritten"]
    assert "model.layers.1.mlp.experts.w13_weight" in r["error"] or "unwritten" in r["error"]


def test_cpu_server_gpt_oss_shards_are_sglangs_layout(dirs):
    """The CPU server's HF-named gpt-oss shards (``cpu_server/sharding.py``) hold what sglang's fused
    parameters hold on the same TP rank (the reference above), for engine TP 2."""
    import json

    from gspo_megatron.cpu_server import expected_shard

    hf = _hf_tensors(dirs["gpt_oss"])
    with open(f"{dirs['gpt_oss']}/config.json") as f:
        cfg = json.load(f)
    blk = "model.layers.1.mlp.experts"
    for rank in range(2):

        def shard(n):
            return expected_shard(n, hf[n], rank, 2, 1, cfg)

        assert torch.equal(
            shard(f"{blk}.gate_up_proj").transpose(1, 2), reference(f"{blk}.w13_weight", hf, cfg, 2, rank)
        )
        assert torch.equal(shard(f"{blk}.gate_up_proj_bias"), reference(f"{blk}.w13_weight_bias", hf, cfg, 2, rank))
        assert torch.equal(shard(f"{blk}.down_proj").transpose(1, 2), reference(f"{blk}.w2_weight", hf, cfg, 2, rank))
        assert torch.equal(shard(f"{blk}.down_proj_bias"), reference(f"{blk}.w2_weight_bias", hf, cfg, 2, rank))
        sinks = "model.layers.0.self_attn.sinks"
        assert torch.equal(shard(sinks), reference(sinks, hf, cfg, 2, rank))


# -- the CPU server: every bucket through sglang's loader, the check at end_weight_update ----------------


def _broadcast_sync(url, buckets, version):
    from gspo_megatron.engines.sglang_client import SGLangHttpClient
    from gspo_megatron.runtime.ports import free_port
    from gspo_megatron.weight_sync.nccl_broadcast import NcclBroadcastTransport

    client = SGLangHttpClient(url)
    transport = NcclBroadcastTransport(
        [client],
        engine_world_sizes=[client.tp_size],
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="gloo",
        device="cpu",
        timeout_s=300,
    )
    try:
        transport.begin(version)
        for b in buckets:
            transport.send_bucket([(n, t.clone()) for n, t in b])
        transport.end()
    finally:
        transport.close()


def test_cpu_server_deepseek_split_sync_fails_naming_the_fused_param(dirs, tmp_path):
    from cpu_server_util import CpuServer
    from gspo_megatron.engines.sglang_client import SGLangError

    hf = _hf_tensors(dirs["deepseek_v3"])
    server = CpuServer(dirs["deepseek_v3"], str(tmp_path), tp=1)
    try:
        with open(server.log_path) as f:
            assert "DeepseekV3ForCausalLM holds this rank's weights too" in f.read()
        fused = f"model.layers.{SPLIT_LAYER}.self_attn.fused_qkv_a_proj_with_mqa.weight"
        with pytest.raises(SGLangError, match=fused.replace(".", r"\.")):
            _broadcast_sync(server.url, _split_deepseek(hf), "1")
        _broadcast_sync(server.url, [sorted(hf.items())], "2")  # the pair in one bucket: complete
    finally:
        server.stop()


def test_cpu_server_serves_gpt_oss_at_engine_tp2(dirs, tmp_path):
    """No longer refused: TP 2 shards, sglang's loader fed every bucket, generation as transformers."""
    import json

    from cpu_server_util import CpuServer
    from gspo_megatron.cpu_server import expected_shard, read_weight_shards
    from gspo_megatron.engines.sglang_client import SGLangHttpClient

    hf = _hf_tensors(dirs["gpt_oss"])
    with open(f"{dirs['gpt_oss']}/config.json") as f:
        cfg = json.load(f)
    g = torch.Generator().manual_seed(5)
    state = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf.items()}
    server = CpuServer(dirs["gpt_oss"], str(tmp_path), tp=2, extra=("--load-format", "dummy"))
    try:
        names = sorted(state)
        _broadcast_sync(server.url, [[(n, state[n]) for n in names[:20]], [(n, state[n]) for n in names[20:]]], "1")
        shards = read_weight_shards(server.url, names)
        for rank in range(2):
            for n in names:
                assert torch.equal(shards[rank][n], expected_shard(n, state[n], rank, 2, 1, cfg)), (n, rank)
        # the assembled model generates with the synced weights: log-probs as transformers' forward
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(dirs["gpt_oss"], dtype=torch.float32).eval()
        model.load_state_dict({**model.state_dict(), **state})
        prompt = [5, 17, 42, 9]
        out = SGLangHttpClient(server.url).generate(
            [prompt], [{"temperature": 0.0, "max_new_tokens": 4}], return_logprob=True
        )[0]
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        ref = logp.gather(-1, ids[0, len(prompt) :, None])[:, 0]
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got, ref)
    finally:
        server.stop()
