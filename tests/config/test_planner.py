"""Planner: parameter counts (against transformers' own models and the published totals), per-GPU
sharding, the memory rows (closed forms), fits / does-not-fit, and engine GPU accounting."""

import json

import pytest
import torch
import transformers

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.arch import KNOWN_ARCHS, detect_arch, model_hf_config
from gspo_megatron.planner import GIB, ModelDims, PlanError, make_plan, param_counts

TINY = KNOWN_ARCHS["tiny-qwen3-moe"]
HF_CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
)


def hf_model(cfg: dict):
    conf_cls, model_cls = HF_CLASSES[cfg["model_type"]]
    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, conf_cls)(**kw))


VARIANTS = {
    "tiny-qwen3-moe": TINY,
    "qwen3_moe with dense layers": {
        **SMALL,
        "model_type": "qwen3_moe",
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "head_dim": 8,
    },
    "mixtral": {**SMALL, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3 dense, tied": {**SMALL, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "qwen2 (qkv bias)": {**SMALL, "model_type": "qwen2"},
    "qwen2_moe (shared expert with gate, dense layers)": {
        **SMALL,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "mlp_only_layers": [2],
    },
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_param_counts_match_transformers_models(name):
    cfg = VARIANTS[name]
    model = hf_model(cfg)
    named = dict(model.named_parameters())
    counts = param_counts(ModelDims.from_hf_config(cfg))
    assert counts.total == sum(p.numel() for p in named.values())
    assert counts.expert == sum(p.numel() for n, p in named.items() if ".experts." in n)
    d = ModelDims.from_hf_config(cfg)
    per_expert = counts.expert // (d.num_experts * len(d.moe_layers)) if d.num_experts else 0
    assert counts.active == counts.total - counts.expert + len(d.moe_layers) * d.topk * per_expert


def test_qwen3_moe_dense_layer_placement_matches_transformers():
    d = ModelDims.from_hf_config(VARIANTS["qwen3_moe with dense layers"])
    model = hf_model(VARIANTS["qwen3_moe with dense layers"])
    hf_moe = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert d.moe_layers == hf_moe == (1,)


@pytest.mark.parametrize(
    "arch, total, active",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],
)
def test_published_totals(arch, total, active):
    c = param_counts(ModelDims.from_hf_config(KNOWN_ARCHS[arch]))
    assert abs(c.total - total) / total < 0.01
    assert abs(c.active - active) / active < 0.025


def test_dims_errors_name_the_key():
    with pytest.raises(PlanError, match="model_type 'gpt2' is not supported"):
        ModelDims.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(PlanError, match="lacks 'num_experts'"):
        ModelDims.from_hf_config({k: v for k, v in TINY.items() if k != "num_experts"})


def test_detect_arch_and_config_source_order(tmp_path):
    assert detect_arch("/models/Qwen3-30B-A3B-Instruct-2507") == "qwen3-30b-a3b"
    assert detect_arch("/m/qwen3_235b_a22b/") == "qwen3-235b-a22b"
    assert detect_arch("/m/Mixtral-8x7B-v0.1") == "mixtral-8x7b"
    assert detect_arch("/m/llama-7b") is None
    cfg = load_config(None, ["model.arch=null", "model.hf_path=/m/Qwen3-235B-A22B"], check_files=False)
    hf, src = model_hf_config(cfg)
    assert hf["num_hidden_layers"] == 94 and "detected from model.hf_path" in src
    cfg = load_config(None, ["model.arch=null", "model.hf_path=/m/unknown"], check_files=False)
    with pytest.raises(ConfigError, match="set model.arch"):
        model_hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 4}))
    cfg = load_config(None, [f"model.hf_path={tmp_path}", "model.arch=qwen3-30b-a3b"])
    hf, src = model_hf_config(cfg)  # a real config.json wins over model.arch
    assert hf["num_hidden_layers"] == 4 and src.endswith("config.json")


def tiny_plan(*overrides, nodes=1, gpus=8, mem=80.0):
    base = [
        "rollout.prompts_per_step=16",
        "rollout.group_size=4",
        "gspo.mini_batches=2",
        "parallel.micro_batch_size=1",
        "model.dtype=bfloat16",
    ]
    return make_plan(load_config(None, base + list(overrides)), nodes, gpus, mem)


def rows(stage, phase="train_items"):
    return {label.split(" (")[0]: b for label, b in getattr(stage, phase)}


def split_params(cfg_dict):
    """(tp-sharded, replicated-over-tp, expert) parameter totals, from transformers' parameter names."""
    named = dict(hf_model(cfg_dict).named_parameters())
    expert = sum(p.numel() for n, p in named.items() if ".experts." in n)
    replicated = sum(p.numel() for n, p in named.items() if "norm" in n or n.endswith("mlp.gate.weight"))
    return sum(p.numel() for p in named.values()) - expert - replicated, replicated, expert


def test_per_gpu_params_and_static_memory_closed_forms():
    sharded, replicated, expert = split_params(TINY)
    for tp, ep, etp in [(1, 1, 1), (2, 1, 2), (2, 4, 1), (1, 2, 1)]:
        plan = tiny_plan(f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.etp={etp}")
        s = plan.stages[0]
        assert s.params == int(sharded / tp + replicated + expert / (ep * etp))
        r = rows(s)
        dense = sharded / tp + replicated
        assert r["weights"] == pytest.approx(s.params * 2, rel=1e-6)
        assert r["gradients"] == pytest.approx(s.params * 4, rel=1e-6)
        edp = 8 // (ep * etp)
        assert plan.dp == 8 // tp and plan.edp == edp
        assert r["optimizer"] == pytest.approx(12 * (dense / plan.dp + expert / (ep * etp) / edp), rel=1e-6)


def test_pipeline_stages_split_the_model():
    plan = tiny_plan("parallel.pp=2")
    first, last = plan.stages
    assert first.layers == (0, 1) and last.layers == (1, 2)
    assert first.params + last.params == param_counts(ModelDims.from_hf_config(TINY)).total
    assert "fused log-prob head" in rows(last) and "fused log-prob head" not in rows(first)
    unfused = tiny_plan("parallel.pp=2", "model.fused_logprobs=false").stages[1]
    assert "logits + grad" in rows(unfused) and "fused log-prob head" not in rows(unfused)
    # 1F1B: the first stage holds pp micro-batches, the last one
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert (
        tiny_plan("parallel.pp=2", "rollout.prompts_per_step=4", "parallel.micro_batch_size=2").stages[0].in_flight == 1
    )


def test_activation_estimate_scales():
    act = lambda *o: rows(tiny_plan(*o).stages[0])["activations"]
    base = act()
    assert act("parallel.micro_batch_size=2") == pytest.approx(2 * base)
    assert act("model.max_seq_len=128") == pytest.approx(2 * base)
    assert act("model.recompute=true") < base


def test_optimizer_variants():
    full = rows(tiny_plan().stages[0])["optimizer"]
    assert rows(tiny_plan("optimizer.cpu_offload_fraction=0.25").stages[0])["optimizer"] == pytest.approx(0.75 * full)
    assert tiny_plan("optimizer.cpu_offload_fraction=0.25").stages[0].host_optimizer == pytest.approx(0.25 * full)
    s = tiny_plan("parallel.use_distributed_optimizer=false").stages[0]
    assert rows(s)["optimizer"] == pytest.approx(12 * s.params)
    s = tiny_plan("model.dtype=float32").stages[0]  # fp32 params: no master copy, fp32 grads
    assert rows(s)["optimizer"] == pytest.approx(full * 8 / 12) and rows(s)["weights"] == s.params * 4
    s = tiny_plan("gspo.kl_coef=0.1").stages[0]
    assert rows(s)["reference model"] == rows(s)["weights"]


SGL = ["rollout.engine=sglang", "model.max_seq_len=64"]


def test_colocated_engine_memory_and_kv_cache():
    plan = tiny_plan(*SGL, "rollout.sync_mode=colocated", "rollout.engine_tp=2", "rollout.engine_mem_fraction=0.5")
    s = plan.stages[0]
    total = param_counts(plan.dims).total
    r = rows(s, "rollout_items")
    assert r["engine weights"] == total * 2 / 2
    resident = sum(rows(s)[k] for k in ("weights", "gradients", "optimizer"))
    assert r["training states"] == pytest.approx(resident)
    assert s.kv_cache == pytest.approx(0.5 * 80 * GIB - 4 * GIB - resident - total)
    assert s.rollout_peak == pytest.approx(0.5 * 80 * GIB)
    assert plan.kv_per_token == 2 * 2 * 1 * 16 * 2  # K+V, 2 layers, 2 kv heads / engine_tp 2, head_dim 16, bf16
    assert plan.num_engines == 4 and plan.train_world == 8
    off = tiny_plan(*SGL, "rollout.sync_mode=colocated", "rollout.engine_tp=2", "rollout.offload_train=true")
    assert rows(off.stages[0], "rollout_items")["training states"] == 0


def test_offload_train_pinned_host_memory_and_the_reference_that_stays():
    """rollout.offload_train: the pinned host copy is the weights + gradients + optimizer rows of the
    training phase (what trainer/offload.py moves), printed by the report; with gspo.kl_coef the
    reference model is not offloaded, so it stays resident while the engines generate."""
    from gspo_megatron.plan_report import format_plan

    on = ["rollout.sync_mode=colocated", "rollout.engine_tp=2", "rollout.offload_train=true"]
    s = tiny_plan(*SGL, *on).stages[0]
    r = rows(s)
    assert s.host_offload == pytest.approx(r["weights"] + r["gradients"] + r["optimizer"]) and s.host_offload > 0
    assert "pinned host memory per GPU for rollout.offload_train" in format_plan(tiny_plan(*SGL, *on))
    kl = tiny_plan(*SGL, *on, "gspo.kl_coef=0.01").stages[0]
    assert kl.host_offload == pytest.approx(s.host_offload)
    label, resident = next((lbl, b) for lbl, b in kl.rollout_items if lbl.startswith("training states"))
    assert resident == pytest.approx(rows(kl)["reference model"]) and resident > 0
    assert "KL reference model stays" in label
    off = tiny_plan(*SGL, "rollout.sync_mode=colocated", "rollout.engine_tp=2").stages[0]
    assert off.host_offload == 0


def test_disaggregated_engines_take_their_own_gpus():
    plan = tiny_plan(
        *SGL, "rollout.sync_mode=disaggregated", "rollout.num_engines=2", "rollout.engine_tp=2", nodes=2, gpus=4
    )
    assert plan.engine_gpus == 4 and plan.train_world == 4 and plan.dp == 4
    assert plan.stages[0].rollout_items == [] and plan.engine_gpu is not None
    assert plan.engine_gpu.kv_cache > 0
    with pytest.raises(ConfigError, match="leave no training GPU out of 8"):
        tiny_plan(*SGL, "rollout.sync_mode=disaggregated", "rollout.num_engines=4", "rollout.engine_tp=2")
    ext = tiny_plan(*SGL, "rollout.sync_mode=disaggregated", "rollout.engine_urls=[http://h:1]")
    assert ext.train_world == 8 and ext.engine_gpu is None


def test_delta_sync_host_copies_by_mode():
    """rollout.sync_delta: colocated, the trainer's copy on the engine's first rank (the bf16 model)
    + the engine TP rank's (the dense tensors and its EP rank's experts: 2 x the bf16 model per GPU
    with engine_ep 1); disaggregated, each stage source's copy of its stage only."""
    colo = tiny_plan(*SGL, "rollout.sync_mode=colocated", "rollout.engine_tp=2", "rollout.sync_delta=true")
    counts = param_counts(colo.dims)
    total = counts.total
    assert colo.stages[0].host_delta == 2 * total * 2
    ep2 = tiny_plan(
        *SGL, "rollout.sync_mode=colocated", "rollout.engine_tp=2", "rollout.engine_ep=2", "rollout.sync_delta=true"
    )
    assert 0 < counts.expert < total
    assert ep2.stages[0].host_delta == pytest.approx(total * 2 + (total - counts.expert / 2) * 2)
    # the DeepSeek-V3 recipe's FP8 engines: the copies hold FP8 codes, a byte per parameter
    recipe = load_config("configs/deepseek_v3_671b_gspo.yaml", ["rollout.sync_delta=true"], check_files=False)
    v3 = make_plan(recipe, 32, 8, 141.0)
    v3_total = param_counts(v3.dims).total
    assert v3.stages[0].host_delta == pytest.approx(2 * v3_total)
    dis = tiny_plan(
        *SGL,
        "rollout.sync_mode=disaggregated",
        "rollout.num_engines=1",
        "rollout.engine_tp=2",
        "rollout.sync_delta=true",
        "parallel.pp=2",
        gpus=6,
    )
    assert dis.train_world == 4 and dis.stages[0].host_delta == pytest.approx(total * 2 / 2)


def test_fits_and_does_not_fit():
    cfg = load_config("configs/qwen3_235b_a22b_gspo.yaml", [], check_files=False)
    # the 235B recipe fits 8x8x80 GiB only through rollout.offload_train (the assertion on
    # offload_train=false below); training does offload (offload.TrainStateOffloader, wired in
    # train.run_step): tests/train/test_offload.py::test_loss_curve_identical_with_offload fails when
    # the loop skips it, and tests/topology/test_multinode.py runs the 235B shape with it
    assert make_plan(cfg, 8, 8, 80).fits
    assert not make_plan(cfg, 8, 8, 40).fits  # training needs ~53 GiB
    assert (
        make_plan(
            load_config("configs/qwen3_235b_a22b_gspo.yaml", ["rollout.offload_train=false"], check_files=False),
            8,
            8,
            80,
        )
        .stages[0]
        .kv_cache
        < 0
    )
    cfg = load_config("configs/qwen3_235b_a22b_gspo.yaml", ["optimizer.cpu_offload_fraction=0"], check_files=False)
    plan = make_plan(cfg, 8, 8, 60)
    assert plan.worst.train_peak > 60 * GIB and not plan.fits
    with pytest.raises(PlanError, match="--nodes must be > 0"):
        make_plan(cfg, 0, 8, 80)


LINEAR_LAST = dict(layer_types=["full_attention", "linear_attention"] * 2, full_attention_interval=None)


@pytest.mark.parametrize(
    "family, pp, extra",
    [("glm4_moe", 1, {}), ("glm4_moe", 2, {}), ("qwen3_next", 2, {}), ("qwen3_next", 1, LINEAR_LAST)],
    ids=["glm4_moe-pp1", "glm4_moe-pp2", "qwen3_next-pp2", "qwen3_next-linear-last"],
)
def test_the_mtp_layer_is_counted_on_the_last_stage(tmp_path, family, pp, extra):
    """``model.mtp``: the last stage holds the MTP layer (its own tensors in the checkpoint, less the
    ``embed_tokens`` / ``shared_head.head`` it shares and the router's ``e_score_correction_bias``, a
    buffer as in the decoder layers), and with PP > 1 its own copy of the embedding. Qwen3-Next's (``mtp.*``)
    is a full-attention layer even where the hybrid stack ends with a Gated DeltaNet layer."""
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(family, str(tmp_path), seed=0, with_mtp=True, **extra)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    tensors = dict(iter_checkpoint(str(tmp_path)))
    own = sum(
        tensors[k].numel()
        for k in mtp_names(model.config.to_dict(), tensors)
        if not k.endswith(("embed_tokens.weight", "shared_head.head.weight", "e_score_correction_bias"))
    )
    base = [f"model.hf_path={tmp_path}", "model.arch=null", "model.max_seq_len=64", f"parallel.pp={pp}"]
    plain, mtp = (tiny_plan(*base, f"model.mtp={on}") for on in ("false", "true"))
    assert [s.params for s in mtp.stages[:-1]] == [s.params for s in plain.stages[:-1]]
    copy = vocab * hidden if pp > 1 else 0
    assert mtp.stages[-1].params - plain.stages[-1].params == own + copy
    assert rows(mtp.stages[-1])["activations"] > rows(plain.stages[-1])["activations"]


@pytest.mark.parametrize("family, extra", [("glm4_moe", {}), ("qwen3_next", {})])
def test_the_speculative_draft_is_counted_in_the_engines_budget(tmp_path, family, extra):
    """``rollout.speculative``: each engine GPU holds the draft's own weights (the checkpoint's MTP tensors
    less the embedding / head copies it shares with the target, over the engine's TP ranks), and sglang's
    draft KV pool spans as many tokens as the target's with one attention layer per MTP layer: the KV
    cache gets that much less, and each of its tokens costs one attention layer more."""
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(family, str(tmp_path), seed=0, with_mtp=True, **extra)
    tensors = dict(iter_checkpoint(str(tmp_path)))
    own = sum(
        tensors[k].numel()
        for k in mtp_names(model.config.to_dict(), tensors)
        if not k.endswith(("embed_tokens.weight", "shared_head.head.weight", "e_score_correction_bias"))
    )
    engine_tp = 2
    base = [
        f"model.hf_path={tmp_path}",
        "model.arch=null",
        "model.max_seq_len=64",
        "rollout.engine=sglang",
        "rollout.sync_mode=colocated",
        f"rollout.engine_tp={engine_tp}",
    ]
    plain, spec = tiny_plan(*base, "model.mtp=true"), tiny_plan(*base, "rollout.speculative=true", "model.mtp=true")
    draft = rows(spec.stages[0], "rollout_items")["speculative draft: 1 MTP layer"]
    assert draft == own * 2 / engine_tp
    assert "speculative draft: 1 MTP layer" not in rows(plain.stages[0], "rollout_items")
    attention = model.config.num_hidden_layers - sum(
        t == "linear_attention" for t in getattr(model.config, "layer_types", None) or []
    )
    assert spec.kv_per_token == plain.kv_per_token * (attention + 1) / attention
    assert spec.stages[0].kv_cache == plain.stages[0].kv_cache - draft
