"""The published Qwen3.5-MoE layout: a ``Qwen3_5MoeForConditionalGeneration`` checkpoint (vision tower +
language model) whose language model is trained while the vision tower is carried through unchanged.

A tiny random checkpoint that transformers 5.23's own ``Qwen3_5MoeForConditionalGeneration`` wrote (the
tiny text config under ``text_config``, a 2-block vision tower under ``model.visual.``), plus an ``mtp.*``
tensor with ``text_config.mtp_num_hidden_layers`` (as the published checkpoint ships one; transformers
ignores it), so that one mechanism (``models/carried.py`` carried tensors) is seen keeping both:

- HF -> Megatron (``convert.hf_to_megatron``) on 1 rank and in TP2 reads the language model under
  ``model.language_model.``; the scorer's log-probs of text rows equal transformers' own forward of the
  vision-language model within 1e-4 (fp32);
- Megatron -> HF (``convert.megatron_to_hf``, the tools' path from the checkpoint's ``hf_assets``) and
  the trainer's final export (``export_to_hf_dir`` with the source directory as assets) write every
  tensor of the source bitwise (vision tower and MTP included, same names and dtypes) and the source's
  config.json (nested ``text_config``, nothing lifted left behind); transformers loads the export;
- the weight-sync stream holds the language model's tensors only (``model.language_model.*``,
  ``lm_head.weight``): no carried tensor.
The stream's load into sglang's own ``Qwen3_5MoeForConditionalGeneration`` is in
tests/rollout/test_sglang_loaders.py (``qwen3_5_moe_vl``).

The engines serve the same directory (issue 22; the run is tests/train/test_qwen3_5_vl_run.py): the
transformers engine (``engines/hf_engine.py``) builds the language model alone and its greedy log-probs
equal transformers' vision-language forward; it and the CPU server's store
(``cpu_server/weights.py``) hold the checkpoint's ``model.language_model.*`` names, take the bare
``model.*`` spelling sglang's ``load_weights`` also takes as the same tensor, skip the vision tower and
``mtp.*``, and refuse a wrong shape.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from distributed_harness import run_ranks
from hf_reference import hf_logprobs, make_rows, max_abs_diff

VL_ARCH = "Qwen3_5MoeForConditionalGeneration"
ROWS = make_rows(seed=3, n=5)
MTP = "mtp.fc.weight"


def _tensors(d: str) -> dict[str, torch.Tensor]:
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    return dict(iter_checkpoint(d))


def save_tiny_vl(d: str, seed: int = 11):
    """The tiny vision-language checkpoint (+ one ``mtp.*`` tensor). Returns transformers' model."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model("qwen3_5_moe", d, seed=seed, architectures=[VL_ARCH])
    tensors = load_file(f"{d}/model.safetensors")
    tensors[MTP] = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
    with open(f"{d}/config.json") as f:
        cfg = json.load(f)
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    return model


def _run(rank, world, hf_dir: str, root: str, rows):
    """Convert in TP ``world``, score, export both ways; the stream's names."""
    from gspo_megatron import convert
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    layout = dict(tp=world)
    init_distributed(ParallelLayout(**layout))
    ckpt = f"{root}/ckpt_tp{world}"
    convert.hf_to_megatron(hf_dir, ckpt, **layout)
    convert.megatron_to_hf(ckpt, f"{root}/tools_tp{world}", **layout, max_shard_size=1 << 16)
    model, hf = convert.load_model(ckpt, **layout)
    lps = score_rows(model, rows, micro_batch_size=3)
    convert.export_to_hf_dir(model, hf, f"{root}/final_tp{world}", 1 << 16, assets_dir=hf_dir)
    streamed = [n for b in export_hf_weights(model, 1 << 16) if b is not None for n, _ in b]
    destroy_distributed()
    return dict(logprobs=lps, streamed=streamed) if rank == 0 else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qwen3_5_vl"))
    hf_dir = f"{root}/hf"
    model = save_tiny_vl(hf_dir)
    ref = hf_logprobs(model, ROWS)
    out = {w: run_ranks(_run, w, hf_dir, root, ROWS, timeout=900)[0] for w in (1, 2)}
    return root, hf_dir, ref, out


def test_family_reads_the_vision_language_config(runs):
    from gspo_megatron.models import get_family
    from gspo_megatron.models.carried import carried_names
    from gspo_megatron.models.hf_config import file_config, load_hf_config

    _, hf_dir, _, _ = runs
    hf = load_hf_config(hf_dir)
    fam = get_family(hf)
    assert fam.name == "qwen3_5_moe" and hf["num_hidden_layers"] == 4 and hf["model_type"] == "qwen3_5_moe"
    with open(f"{hf_dir}/config.json") as f:
        assert file_config(hf) == json.load(f)
    names = list(_tensors(hf_dir))
    carried = carried_names(hf, names)
    assert MTP in carried and all(n.startswith(("model.visual.", "mtp.")) for n in carried)
    assert len(carried) == sum(n.startswith(("model.visual.", "mtp.")) for n in names)
    with pytest.raises(ValueError, match="text_config"):
        fam.check(file_config(hf))  # the raw nested dict: refused, naming the field


@pytest.mark.parametrize("world", [1, 2])
def test_text_logprobs_equal_transformers(runs, world):
    _, _, ref, out = runs
    assert max_abs_diff(out[world]["logprobs"], ref) < 1e-4


@pytest.mark.parametrize("kind", ["tools", "final"])
@pytest.mark.parametrize("world", [1, 2])
def test_export_is_the_source_checkpoint_bitwise(runs, world, kind):
    root, hf_dir, _, _ = runs
    src, got = _tensors(hf_dir), _tensors(f"{root}/{kind}_tp{world}")
    assert sorted(got) == sorted(src)
    for name, t in src.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    with open(f"{hf_dir}/config.json") as f, open(f"{root}/{kind}_tp{world}/config.json") as g:
        assert json.load(g) == json.load(f)
    assert len(os.listdir(f"{root}/{kind}_tp{world}")) > 3  # sharded (index + shards)


def test_transformers_loads_the_export(runs):
    import transformers

    root, _, ref, _ = runs
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(f"{root}/tools_tp2", dtype=torch.float32)
    assert max_abs_diff(hf_logprobs(model, ROWS), ref) == 0.0


def test_weight_stream_holds_the_language_model_only(runs):
    _, hf_dir, _, out = runs
    src = _tensors(hf_dir)
    want = sorted(n for n in src if n.startswith("model.language_model.") or n == "lm_head.weight")
    for world in (1, 2):
        assert sorted(out[world]["streamed"]) == want


# -- the engines on the vision-language directory (issue 22) --------------------------------------------


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("qwen3_5_vl_engine") / "hf")
    save_tiny_vl(d)
    return d


def _language_model(d: str) -> dict[str, torch.Tensor]:
    return {n: t for n, t in _tensors(d).items() if n.startswith("model.language_model.") or n == "lm_head.weight"}


def test_hf_engine_serves_the_language_model(vl_dir):
    import transformers

    from gspo_megatron.engines.base import SamplingParams
    from gspo_megatron.engines.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(vl_dir, vl_dir)  # the directory's every tensor: vision tower and mtp.* skipped
    assert type(engine.model).__name__ == "Qwen3_5MoeForCausalLM"
    lm = _language_model(vl_dir)
    assert sorted(engine.checkpoint_names()) == sorted(lm)
    assert all(torch.equal(engine.layout.target(n), t) for n, t in lm.items())
    prompts = [r for r in ROWS if len(r) > 1]
    out = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=4))  # left-padded batch
    vl = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
    rows = [p + s[0].response_ids for p, s in zip(prompts, out)]
    ref = [lp[len(p) - 1 :] for p, lp in zip(prompts, hf_logprobs(vl, rows))]
    assert max_abs_diff([s[0].response_logprobs for s in out], ref) < 1e-4

    name = "model.language_model.layers.1.self_attn.q_proj.weight"
    new = torch.randn_like(lm[name])
    engine.update_weights([(name.replace("language_model.", "", 1), new)])  # sglang's other spelling
    assert torch.equal(engine.layout.target(name), new)
    with pytest.raises(ValueError, match="does not match"):
        engine.update_weights([(name, new[:, :3])])


@pytest.mark.parametrize("tp", [1, 2])
def test_cpu_server_store_holds_the_checkpoint_names(vl_dir, tp):
    from gspo_megatron.cpu_server import expected_shard
    from gspo_megatron.cpu_server.sharding import Layout
    from gspo_megatron.cpu_server.weights import ShardStore, iter_checkpoint, load_config

    config = load_config(vl_dir)
    lm = _language_model(vl_dir)
    stores = [ShardStore(config, Layout.from_config(config, tp), r, torch.float32) for r in range(tp)]
    for rank, store in enumerate(stores):
        assert sorted(store.full_shapes) == sorted(lm)
        assert store.skipped("model.visual.blocks.0.attn.qkv.weight") and store.skipped(MTP)
        assert store.load(iter_checkpoint(vl_dir)) == len(store.shards)  # every language-model tensor held
        for n, t in lm.items():
            assert torch.equal(store.shards[n], expected_shard(n, t, rank, tp, 1, config)), (n, rank)
        name = "model.language_model.layers.1.self_attn.k_proj.weight"
        new = torch.randn_like(lm[name])
        assert store.load([(name.replace("language_model.", "", 1), new)]) == 1  # sglang's other spelling
        assert torch.equal(store.shards[name], expected_shard(name, new, rank, tp, 1, config))
        with pytest.raises(ValueError, match="does not match"):
            store.load([("model.norm.weight", torch.ones(3))])
