"""The MTP layer inside the Megatron model (``model.mtp``, gspo_megatron/models/mtp.py), GLM-4.5 and
DeepSeek-V3 tiny checkpoints with the published MTP layout:

- HF -> Megatron (with the MTP layer) -> HF, through the final export (``convert.export_to_hf_dir``) and
  through a Megatron checkpoint read back by the conversion tool's path (``convert.megatron_to_hf``: the
  checkpoint's metadata says it holds the MTP layer): every tensor bitwise, the MTP layer's own from
  the model, its ``embed_tokens`` / ``shared_head.head`` carried;
- the weight-sync stream (``export_hf_weights``) carries the MTP layer under sglang's draft names, not
  the two carried copies;
- the Megatron MTP layer's output equals the published MTP math on the HF tensors
  (``engines.mtp_draft.MTPDraft`` with transformers' own decoder layer) fed transformers' target states;
- refusals name ``model.mtp``.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

FAMILIES = ["glm4_moe", "deepseek_v3"]


def _round_trip(rank, world, hf_dir: str, root: str) -> dict:
    import os

    from gspo_megatron import convert
    from gspo_megatron.checkpoint.manager import write_checkpoint_dir
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lm_head import lm_forward
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout())
    hf = load_hf_config(hf_dir)
    model = convert.build_empty_model(hf, 1, 1, 1, None, 1, "float32", mtp=True)
    convert.load_hf_into(model, hf_dir)
    convert.export_to_hf_dir(model, hf, f"{root}/final", 5 * 10**9, assets_dir=hf_dir)
    write_checkpoint_dir(f"{root}/ckpt", 0, model, hf_assets_dir=hf_dir, save_rng=False)
    streamed = [n for bucket in export_hf_weights(model, 1 << 20) for n, _ in bucket]
    tokens = torch.randint(0, hf["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    drafts: list = []
    with torch.no_grad():
        hidden, _w = lm_forward(
            model, tokens, torch.arange(11).expand(2, 11), fused=True, attention_mask=None, drafts=drafts
        )
        plain, _w = lm_forward(model, tokens, torch.arange(11).expand(2, 11), fused=True, attention_mask=None)
    convert.megatron_to_hf(f"{root}/ckpt", f"{root}/export")
    destroy_distributed()
    return dict(
        streamed=streamed,
        hidden=hidden,
        plain=plain,
        draft=drafts[0],
        tokens=tokens,
        stored=os.path.isfile(f"{root}/ckpt/hf_assets/carried.safetensors"),
    )


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp(request.param)
    hf_dir = str(root / "hf")
    model = save_tiny_hf_model(request.param, hf_dir, seed=7, with_mtp=True)
    (r,) = run_ranks(_round_trip, 1, hf_dir, str(root))
    return request.param, model, dict(iter_checkpoint(hf_dir)), root, r


def test_round_trip_bitwise_with_the_mtp_layer_in_the_model(converted):
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    _family, model, source, root, r = converted
    n = model.config.num_hidden_layers
    mtp = {k for k in source if k.startswith(f"model.layers.{n}.")}
    carried = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    assert carried < mtp and r["stored"]
    for out in ("final", "export"):
        got = dict(iter_checkpoint(str(root / out)))
        assert sorted(got) == sorted(source), out
        for k, t in source.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), (out, k)
    streamed = set(r["streamed"])
    assert mtp - carried <= streamed and not carried & streamed


def test_the_mtp_layer_is_the_published_math_and_the_main_path_is_untouched(converted):
    from gspo_megatron.engines.mtp_draft import MTPDraft

    _family, model, source, _root, r = converted
    n = model.config.num_hidden_layers
    assert torch.equal(r["hidden"], r["plain"])  # asking for the draft leaves the main states as they are
    mtp = {k: v for k, v in source.items() if k.startswith(f"model.layers.{n}.")}
    model.eval()
    draft = MTPDraft(model.config, mtp, model.model.embed_tokens.weight, model.lm_head.weight)
    tokens = r["tokens"]
    t = tokens.shape[1]
    with torch.no_grad():
        h = model(tokens, output_hidden_states=True).hidden_states[-1]
        for b in range(tokens.shape[0]):
            g, _logits = draft(h[b, : t - 1], tokens[b, 1:], torch.arange(t - 1))
            torch.testing.assert_close(r["draft"][b, : t - 1], g, rtol=1e-5, atol=1e-5)


def _build_refused(rank, world, hf: dict, pp: int) -> str:
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(pp=pp))
    try:
        build_model(hf, 1, pp, 1, opts=ModelOptions(mtp=True))
    except ValueError as e:
        return str(e)
    finally:
        destroy_distributed()
    return ""


@pytest.mark.parametrize(
    "family, extra, match",
    [
        ("qwen3_moe", {}, r"model.mtp: the qwen3_moe family has no MTP layers"),
        ("glm4_moe", {"num_nextn_predict_layers": 0}, r"model.mtp: config.json declares no MTP layer"),
        ("glm4_moe", {"num_nextn_predict_layers": 2}, r"sglang 0.5.23 serves exactly 1"),
    ],
)
def test_build_refusals_name_model_mtp(family, extra, match):
    import re

    from tiny_models import tiny_hf_config

    (msg,) = run_ranks(_build_refused, 1, tiny_hf_config(family, **extra), 1)
    assert re.search(match, msg) and "\n" not in msg, msg
