"""engines/mtp_draft.MTPDraft, the MTP layer's reference forward, against a hand-written few-line version:
the published math written out (RMSNorm by its formula, eh_proj a matmul, the embedding half first) around
transformers' own one-layer model of the family (its causal mask and rotary path, not the draft's), whose
final norm is the MTP layer's ``shared_head.norm``. Also: transformers' last ``hidden_states`` entry is
the post-norm state the head reads (what the draft's h is), and the draft is causal over its inputs."""

from __future__ import annotations

import pytest
import torch

from mtp_util import mtp_tensors

FAMILIES = ["glm4_moe", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    import json

    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(tmp_path_factory.mktemp(request.param))
    model = save_tiny_hf_model(request.param, d, seed=3, num_nextn_predict_layers=1).eval()
    with open(f"{d}/config.json") as f:
        hf = json.load(f)
    return hf, model, mtp_tensors(model, hf)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hand_written(hf, model, mtp, hidden, ids, pos):
    """The MTP math of the module docstring, the decoder layer run inside transformers' own one-layer model."""
    import transformers

    from gspo_megatron.engines.hf_engine import HFCheckpointLayout

    n, eps = hf["num_hidden_layers"], hf["rms_norm_eps"]
    p = f"model.layers.{n}."
    cfg = {k: v for k, v in hf.items() if k not in ("transformers_version", "architectures", "model_type")}
    cfg.update(num_hidden_layers=1, first_k_dense_replace=0)  # its one layer built as layer N is (experts)
    one = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(hf["model_type"], **cfg)).eval()
    layout = HFCheckpointLayout(one)
    for name, t in mtp.items():
        rest = name[len(p) :]
        if rest.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            layout.load("layers.0." + rest, t)
    with torch.no_grad():
        one.norm.weight.copy_(mtp[p + "shared_head.norm.weight"])
        e = model.model.embed_tokens.weight[ids]
        z = torch.cat([_rms(e, mtp[p + "enorm.weight"], eps), _rms(hidden, mtp[p + "hnorm.weight"], eps)], -1)
        z = z @ mtp[p + "eh_proj.weight"].t()
        g = one(inputs_embeds=z[None], position_ids=pos[None]).last_hidden_state[0]
        return g, g @ model.lm_head.weight.t()


def test_mtp_draft_matches_hand_written(tiny):
    from gspo_megatron.engines.mtp_draft import MTPDraft

    hf, model, mtp = tiny
    draft = MTPDraft(hf, mtp, model.model.embed_tokens.weight, model.lm_head.weight)
    gen = torch.Generator().manual_seed(0)
    t = 9
    hidden = torch.randn(t, hf["hidden_size"], generator=gen)
    ids = torch.randint(0, hf["vocab_size"], (t,), generator=gen)
    pos = torch.arange(t) + 4  # RoPE at the given positions, not 0..T-1
    g, logits = draft(hidden, ids, pos)
    g_ref, logits_ref = _hand_written(hf, model, mtp, hidden, ids, pos)
    assert g.shape == (t, hf["hidden_size"]) and logits.shape == (t, hf["vocab_size"])
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=1e-4)
    # the positions matter (RoPE is relative: a uniform shift changes nothing, a stretch does), and
    # attention is causal over j
    g_shift, _ = draft(hidden, ids, torch.arange(t))
    torch.testing.assert_close(g_shift, g, rtol=1e-4, atol=1e-4)
    g_stretch, _ = draft(hidden, ids, 2 * torch.arange(t))
    assert (g_stretch[1:] - g[1:]).abs().max() > 1e-5
    ids2 = ids.clone()
    ids2[-1] = (ids[-1] + 1) % hf["vocab_size"]
    g2, _ = draft(hidden, ids2, pos)
    torch.testing.assert_close(g2[:-1], g[:-1], rtol=0, atol=1e-5)
    assert not torch.allclose(g2[-1], g[-1])


def test_mtp_draft_names_and_refusals(tiny):
    from gspo_megatron.engines.mtp_draft import MTPDraft

    hf, model, mtp = tiny
    n = hf["num_hidden_layers"]
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    draft = MTPDraft(hf, mtp, embed, head)
    shared = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    assert set(draft.names()) == set(mtp) - shared  # the layer's own copies of embed / head are not used
    assert draft.embed is embed and draft.lm_head is head  # the target's, by reference
    assert not any(p is embed or p is head for p in draft.parameters())
    partial = {k: v for k, v in mtp.items() if not k.endswith("eh_proj.weight")}
    with pytest.raises(ValueError, match="lack 1 names"):
        MTPDraft(hf, partial, embed, head)
    with pytest.raises(KeyError, match="unknown weight name"):
        MTPDraft(hf, {**mtp, f"model.layers.{n}.nonsense.weight": torch.zeros(1)}, embed, head)


def test_transformers_last_hidden_state_is_post_norm(tiny):
    """The h the draft reads: transformers' last ``hidden_states`` entry is the final norm's output, the
    state the head reads (as sglang's LogitsProcessor captures for the draft)."""
    hf, model, _ = tiny
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        last = out.hidden_states[-1]
        torch.testing.assert_close(last, model.model(ids).last_hidden_state, rtol=0, atol=0)
        torch.testing.assert_close(out.logits, last @ model.lm_head.weight.t(), rtol=1e-5, atol=1e-5)
        pre = model.model.norm.weight
        assert not torch.allclose(pre, torch.ones_like(pre))  # the norm is not an identity here
