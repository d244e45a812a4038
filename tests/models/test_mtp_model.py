"""The MTP layer inside the Megatron model (``model.mtp``, gspo_megatron/models/mtp.py), GLM-4.5,
DeepSeek-V3 and Qwen3-Next tiny checkpoints with the published MTP layout (a MoE MTP layer; Qwen3-Next's
``mtp.*`` branch of full attention, zero-centered norms, the hybrid model's last layer), in TP1, TP2 x EP2 (ETP1, two
ranks) and TP2 x PP2 x EP2 (four ranks: the MTP block on the last stage with its embedding copy); right-
padded rows and packed sequences (``tests/models/mtp_workers.py`` runs the ranks):

- HF -> Megatron (with the MTP layer) -> HF, through the final export (``convert.export_to_hf_dir``) and
  through a Megatron checkpoint read back in TP1 by the conversion tool's path (``convert.megatron_to_hf``:
  the checkpoint's metadata says it holds the MTP layer): every tensor bitwise, the MTP layer's own from
  the model, its ``embed_tokens`` / ``shared_head.head`` carried; the weight-sync stream
  (``export_hf_weights``) carries the MTP layer under sglang's draft names, not the two carried copies;
- the Megatron MTP layer's output equals the published MTP math on the HF tensors
  (``engines.mtp_draft.MTPDraft``: transformers' own decoder layer) fed transformers' target states;
- gradient isolation: with drafts asked and a loss on them, every non-MTP parameter's gradient and the
  main hidden states are bitwise those of the model built without MTP (the PP last stage's embedding copy
  gets none), and the MTP layer's own parameters get one; not asked, the MTP block does not run and the
  MTP model is the plain one bit for bit; a loss on the drafts alone gives no policy parameter a gradient,
  with and without ``model.recompute`` (megatron's checkpointed MTP layer: the same gradients, bitwise);
- refusals name ``model.mtp`` in one line.
"""

from __future__ import annotations

import re

import pytest
import torch

from distributed_harness import run_ranks
from mtp_workers import build_refused, draft_loss_grads, layout_run, te_and_local_drafts

FAMILIES = ["glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe_vl"]
# a tiny checkpoint of a family in another layout: Qwen3.5-MoE's published vision-language checkpoint (its
# language model under model.language_model., the vision tower carried, the MTP layer under mtp.*)
VARIANTS = {"qwen3_5_moe_vl": ("qwen3_5_moe", {"architectures": ["Qwen3_5MoeForConditionalGeneration"]})}
LAYOUTS = {  # name: (world size, layout)
    "tp1": (1, {}),
    "tp2-ep2": (2, {"tp": 2, "ep": 2, "etp": 1}),
    "tp2-pp2-ep2": (4, {"tp": 2, "pp": 2, "ep": 2, "etp": 1}),
}
PADDED_LENS, PACKED_LENS = (12, 7), (12, 8)  # sequence lengths (multiples of TP 2 where SP splits them)


def _batches(vocab: int) -> list[dict]:
    """Right-padded rows (pad id 0) and one packed row (positions restart per sequence)."""
    g = torch.Generator().manual_seed(0)
    s = max(PADDED_LENS)
    padded = torch.randint(1, vocab, (len(PADDED_LENS), s), generator=g)
    for row, n in enumerate(PADDED_LENS):
        padded[row, n:] = 0
    packed = torch.randint(1, vocab, (1, sum(PACKED_LENS)), generator=g)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENS).cumsum(0).tolist()])
    return [
        dict(tokens=padded, position_ids=torch.arange(s).expand(len(PADDED_LENS), s).contiguous(), cu=None),
        dict(tokens=packed, position_ids=torch.cat([torch.arange(n) for n in PACKED_LENS])[None], cu=cu),
    ]


def _sequences(batches: list[dict]) -> list[tuple[int, int, int, int]]:
    """(batch, row, start, length) of every real sequence of :func:`_batches`."""
    padded = [(0, row, 0, n) for row, n in enumerate(PADDED_LENS)]
    starts = torch.tensor([0, *PACKED_LENS[:-1]]).cumsum(0).tolist()
    return padded + [(1, 0, a, n) for a, n in zip(starts, PACKED_LENS)]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp(request.param)
    hf_dir = str(root / "hf")
    family, extra = VARIANTS.get(request.param, (request.param, {}))
    model = save_tiny_hf_model(family, hf_dir, seed=7, with_mtp=True, **extra).eval()
    return (
        request.param,
        hf_dir,
        model,
        dict(iter_checkpoint(hf_dir)),
        _batches(model.config.get_text_config().vocab_size),
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, checkpoint, tmp_path_factory):
    family, hf_dir, model, source, batches = checkpoint
    world, layout = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"{family}-{request.param}")
    ranks = run_ranks(layout_run, world, hf_dir, str(root), layout, batches)
    return dict(model=model, source=source, batches=batches, root=root, ranks=ranks, pp=layout.get("pp", 1))


def _mtp_names(model, names) -> tuple[set[str], set[str]]:
    """(the MTP layer's names among ``names``, the names that stay carried with the MTP layer trained: its
    copies of the embedding and head, and a vision-language checkpoint's vision tower)."""
    from gspo_megatron.models.carried import carried_names, mtp_names
    from gspo_megatron.models.hf_config import lift_text_config
    from gspo_megatron.models.mtp import mtp_naming

    hf = lift_text_config(model.config.to_dict())
    mtp = set(mtp_names(hf, names))
    return mtp, set(mtp_naming(hf).shared_names(hf)) | (set(carried_names(hf, names)) - mtp)


def test_round_trip_bitwise_with_the_mtp_layer_in_the_model(run):
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    source, root = run["source"], run["root"]
    mtp, carried = _mtp_names(run["model"], source)
    assert len(mtp) > 20
    assert (root / "ckpt" / "hf_assets" / "carried.safetensors").is_file()  # the published layer, kept
    for out in ("final", "export"):
        got = dict(iter_checkpoint(str(root / out)))
        assert sorted(got) == sorted(source), out
        for k, t in source.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (out, k)
    streamed = run["ranks"][0]["streamed"]
    assert len(streamed) == len(set(streamed))
    assert set(streamed) == set(source) - carried  # the main model and the MTP layer's own, once each


def test_the_mtp_layer_is_the_published_math(run):
    from gspo_megatron.engines.mtp_draft import MTPDraft

    model, source, batches = run["model"], run["source"], run["batches"]
    names, _ = _mtp_names(model, source)
    mtp = {k: source[k] for k in names}
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    draft = MTPDraft(model.config, mtp, embed, head)
    last = [r for r in run["ranks"] if r["last"]]
    assert last and all(len(r["mtp"][b]["drafts"]) == 1 for r in last for b in range(len(batches)))
    with torch.no_grad():
        for b, row, a, length in _sequences(batches):
            ids = batches[b]["tokens"][row, a : a + length]
            h = model(ids[None], output_hidden_states=True).hidden_states[-1][0]  # [T, H], post-norm
            # MTP inputs j = 0..T-2: (h_j, t_{j+1}) at position j, predicting t_{j+2} (models/mtp.py)
            want, _logits = draft(h[: length - 1], ids[1:], torch.arange(length - 1))
            for r in last:  # every TP rank of the last stage holds the gathered states
                got = r["mtp"][b]["drafts"][0][row, a : a + length - 1]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_drafts_move_only_the_mtp_layer_and_leave_the_main_path_bitwise(run):
    for r in run["ranks"]:
        assert r["unasked_mtp_runs"] == 0  # not asked: the MTP block does not run
        for plain, mtp, unasked in zip(r["plain"], r["mtp"], r["unasked"]):
            own = {n for n in mtp["grads"] if n.startswith("mtp.")}
            assert own or not r["last"], "the last stage holds the MTP layer"
            copies = set(mtp["grads"]) - own - set(plain["grads"])  # the MTP stage's embedding copy (PP)
            assert copies == ({"embedding.word_embeddings.weight"} if r["last"] and run["pp"] > 1 else set())
            for name in copies:
                g = mtp["grads"][name]
                assert g is None or not g.any(), name
            for name, g in plain["grads"].items():
                assert _same(g, mtp["grads"][name]), name  # the draft's loss reaches no policy parameter
                assert _same(g, unasked["grads"][name]), name
            assert all(unasked["grads"][name] is None for name in own)
            if r["last"]:
                assert torch.equal(plain["hidden"], mtp["hidden"]) and torch.equal(plain["hidden"], unasked["hidden"])
                moved = {n for n in own if mtp["grads"][n] is not None and mtp["grads"][n].any()}
                experts = {n for n in own if ".experts." in n}
                assert own - experts <= moved, sorted(own - experts - moved)  # enorm, hnorm, eh_proj, layer, norm
                assert experts & moved  # routed experts that got tokens


@pytest.mark.parametrize(
    "family, extra, layout, match",
    [
        ("qwen3_moe", {}, {}, r"^model.mtp: the qwen3_moe family has no MTP layers"),
        ("glm4_moe", {"num_nextn_predict_layers": 0}, {}, r"^model.mtp: config.json declares no MTP layer"),
        ("glm4_moe", {"num_nextn_predict_layers": 2}, {}, r"sglang 0.5.23 serves exactly 1"),
        (
            "glm4_moe",
            {"num_nextn_predict_layers": 1, "tie_word_embeddings": True},
            {"pp": 2},
            r"model.mtp=true with config.json tie_word_embeddings=true needs parallel.pp=1 \(got 2\)",
        ),
    ],
)
def test_build_refusals_name_model_mtp(family, extra, layout, match):
    from tiny_models import tiny_hf_config

    msgs = run_ranks(build_refused, layout.get("pp", 1), tiny_hf_config(family, **extra), layout)
    for msg in msgs:
        assert re.search(match, msg) and "\n" not in msg, msg


@pytest.mark.parametrize(
    "family, extra, match",
    [
        ("minimax_m2", {"num_mtp_modules": 1}, r"the minimax_m2 family's MTP layers are not built .* yet"),
        ("deepseek_v32", {"num_nextn_predict_layers": 1}, r"the deepseek_v32 family's MTP layers are not built"),
        ("qwen3_5_moe", {}, r"declares no MTP layer .*: the checkpoint has no draft"),
        ("mixtral", {}, r"the mixtral family has no MTP layers"),
        ("deepseek_v3", {"num_nextn_predict_layers": 1, "first_k_dense_replace": 4}, r"first_k_dense_replace=4"),
        ("qwen3_next", {"mtp_num_hidden_layers": 1, "mlp_only_layers": [3]}, r"mlp_only_layers=\[3\] .* dense"),
        ("qwen3_next", {"mtp_num_hidden_layers": 2}, r"2 MTP layers; .*srt/models/qwen3_next_mtp.py loads one"),
    ],
)
def test_mtp_errors_say_not_built_yet_or_none(family, extra, match):
    from gspo_megatron.models.mtp import mtp_errors
    from tiny_models import tiny_hf_config

    (msg,) = mtp_errors(tiny_hf_config(family, **extra))
    assert re.search(match, msg) and "\n" not in msg, msg


def test_layout_refusals():
    from gspo_megatron.models.mtp import mtp_layout_errors

    assert mtp_layout_errors(2, 1, {"tie_word_embeddings": False}) == []
    (cp,) = mtp_layout_errors(1, 2)
    assert "parallel.cp=1 (got 2)" in cp


def test_draft_fields_are_not_inherited():
    """DeepSeek-V3.2 and GLM-5 subclass DeepSeek-V3's family but not its MTP support; Qwen3.5-MoE subclasses
    Qwen3-Next's and declares its own draft class (the checkpoint naming is inherited: ``mtp.*``)."""
    from gspo_megatron.models.mtp import AFTER_DECODER, MTP_BRANCH
    from gspo_megatron.models.registry import families

    built = {f.name: f.sglang_draft_modules for f in families() if f.mtp_trainable}
    assert built == {
        "glm4_moe": {"Glm4MoeForCausalLMNextN": "glm4_moe_nextn"},
        "deepseek_v3": {"DeepseekV3ForCausalLMNextN": "deepseek_nextn"},
        "qwen3_next": {"Qwen3NextForCausalLMMTP": "qwen3_next_mtp"},
        "qwen3_5_moe": {"Qwen3_5ForCausalLMMTP": "qwen3_5_mtp"},
    }
    naming = {f.name: f.mtp_naming for f in families()}
    assert naming["qwen3_next"] is naming["qwen3_5_moe"] is MTP_BRANCH
    assert naming["deepseek_v3"] is naming["deepseek_v32"] is naming["glm4_moe"] is AFTER_DECODER


def test_a_draft_loss_alone_reaches_only_the_mtp_layer_with_and_without_recompute(checkpoint):
    _family, hf_dir, _model, _source, batches = checkpoint
    (r,) = run_ranks(draft_loss_grads, 1, hf_dir, batches[0]["tokens"])
    for recompute, grads in r.items():
        own = {n for n in grads if n.startswith("mtp.")}
        assert own and all(grads[n] is None for n in set(grads) - own), recompute  # no policy parameter
        assert all(grads[n] is not None for n in own if ".experts." not in n), recompute
    for n in r[False]:
        assert _same(r[False][n], r[True][n]), n  # recompute (megatron's checkpointed MTP layer): same grads


def test_an_fp8_sync_quantizes_the_mtp_layer_as_sglangs_draft_builds_it(checkpoint):
    """``rollout.sync_fp8`` (GPU engines only; the CPU server refuses it): sglang 0.5.23's draft
    (``srt/models/deepseek_nextn.py``, which GLM-4.5's ``glm4_moe_nextn.py`` follows; Qwen3-Next's
    ``qwen3_next_mtp.py``) builds ``eh_proj`` / ``fc`` as a plain ``nn.Linear`` (not quantized), its norms as
    RMSNorm, and its decoder layer with the target's quantization config: the sync quantizes exactly the
    MTP layer's decoder-layer projections the target's layers have quantized."""
    from gspo_megatron.models.mtp import mtp_naming
    from gspo_megatron.weight_sync.fp8_quant import is_fp8_quantizable

    _family, _hf_dir, model, source, _batches = checkpoint
    from gspo_megatron.models.hf_config import lift_text_config
    from gspo_megatron.models.registry import get_family

    hf = lift_text_config(model.config.to_dict())
    naming, n = mtp_naming(hf), hf["num_hidden_layers"]
    lm = get_family(hf).language_model_prefix if "text_config" in hf else None
    last, prefix = f"{lm or 'model.'}layers.{n - 1}.", naming.prefix(hf)
    own = set(naming.own(hf).values())
    assert own <= set(source)
    assert not {k for k in own if is_fp8_quantizable(k, source[k])}
    mtp = {k[len(prefix) :]: t for k, t in source.items() if k.startswith(prefix) and k not in own}
    quantized = {k for k, t in mtp.items() if is_fp8_quantizable(prefix + k, t)}
    layer = {k for k, t in mtp.items() if last + k in source}  # the decoder layer's names
    assert quantized == {k for k in layer if is_fp8_quantizable(last + k, source[last + k])}
    assert any("self_attn" in k for k in quantized) and any("experts" in k for k in quantized)


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next"])
def test_the_mtp_layer_on_transformer_engines_spec_equals_the_local_one(family, tmp_path):
    """``transformer_impl: transformer_engine`` (megatron's TE MTP spec: ``TENorm`` honoring Qwen3-Next's
    zero-centered gamma, ``TEColumnParallelLinear`` eh_proj, the TE decoder layer; over the CPU stand-in,
    tests/models/te_standin.py) holds the checkpoint's MTP layer as the local spec does: the same draft
    states and main output, and the same MTP tensors exported, the checkpoint's own."""
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(family, hf_dir, seed=7, with_mtp=True)
    tokens = torch.randint(1, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    (r,) = run_ranks(te_and_local_drafts, 1, hf_dir, tokens)
    te, local = r["transformer_engine"], r["local"]
    assert (
        te["classes"]["eh_proj"] == "TEColumnParallelLinear" and local["classes"]["eh_proj"] == "ColumnParallelLinear"
    )
    assert te["classes"]["linear_qkv"] == "TELayerNormColumnParallelLinear"
    assert te["classes"]["self_attention"] == local["classes"]["self_attention"] == "SelfAttention"  # full attention
    torch.testing.assert_close(te["logits"], local["logits"], rtol=0, atol=1e-6)
    assert len(te["drafts"]) == len(local["drafts"]) == 1
    torch.testing.assert_close(te["drafts"][0], local["drafts"][0], rtol=0, atol=1e-6)
    source = dict(iter_checkpoint(hf_dir))
    assert sorted(te["export"]) == sorted(local["export"]) and len(te["export"]) > 20
    for name, t in te["export"].items():
        assert torch.equal(t, local["export"][name]) and torch.equal(t, source[name]), name
