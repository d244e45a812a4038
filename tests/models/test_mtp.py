"""Multi-token-prediction layers carried through unchanged (gspo_megatron/models/carried.py).

Tiny checkpoints written by transformers (deepseek_v3, deepseek_v32, glm_moe_dsa with num_nextn_predict_layers=1,
minimax_m2 with num_mtp_modules=1) get the published MTP layout added (``model.layers.<N>.*``: enorm,
hnorm, eh_proj, shared_head.{norm,head}, embed_tokens and a whole decoder layer, copied from layer N-1
and perturbed; one bf16 and one float8_e4m3 tensor with its fp32 ``weight_scale_inv``, as block-FP8
checkpoints store them). Then:
- HF -> Megatron keeps them in ``<ckpt>/hf_assets/carried.safetensors``; Megatron -> HF (sharded) writes
  every tensor of the source bitwise (same names, dtypes, bytes), MTP included, and the index lists them;
- the trainer's final export (assets = the source HF directory) does the same;
- the weight-sync stream (``export_hf_weights``) carries no MTP tensor: sglang 0.5.23's target model
  skips them (deepseek_weight_loader.py: layers >= num_hidden_layers ``continue`` unless ``is_nextn``),
  its draft model reads them from the checkpoint directory;
- transformers loads the export and computes what it computed on the source.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from distributed_harness import run_ranks
from gspo_megatron.cpu_server.weights import iter_checkpoint

CASES = {
    "deepseek_v3": dict(num_nextn_predict_layers=1),
    "deepseek_v32": dict(num_nextn_predict_layers=1),
    "glm_moe_dsa": dict(num_nextn_predict_layers=1),
    "minimax_m2": dict(num_mtp_modules=1),
}


def _tensors(d: str) -> dict:
    return dict(iter_checkpoint(d))


def add_mtp_layer(hf_dir: str, n_layers: int, hidden: int, vocab: int) -> list[str]:
    """Rewrite ``hf_dir``'s model.safetensors with an MTP layer ``model.layers.<n_layers>.*`` added."""
    t = load_file(f"{hf_dir}/model.safetensors")
    g = torch.Generator().manual_seed(5)
    src, dst = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    mtp = {
        dst + k[len(src) :]: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype)
        for k, v in t.items()
        if k.startswith(src)
    }
    mtp.update(
        {
            dst + "enorm.weight": torch.randn(hidden, generator=g),
            dst + "hnorm.weight": torch.randn(hidden, generator=g),
            dst + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
            dst + "shared_head.norm.weight": torch.randn(hidden, generator=g).bfloat16(),
            dst + "shared_head.head.weight": torch.randn(vocab, hidden, generator=g),
            dst + "embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
            dst + "fp8_probe.weight": torch.randn(16, hidden, generator=g).to(torch.float8_e4m3fn),
            dst + "fp8_probe.weight_scale_inv": torch.rand(1, 1, generator=g),
        }
    )
    save_file({**t, **mtp}, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    return sorted(mtp)


def convert_export_stream(rank, world, cases: list[tuple[str, str]]) -> dict:
    """Every case ``(hf_dir, root)`` in this one rank (starting a rank, torch and Megatron imported, costs
    more than converting a tiny model): HF -> Megatron -> HF, the final export, the sync stream."""
    import os

    from gspo_megatron import convert
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    out = {}
    for hf_dir, root in cases:
        init_distributed(ParallelLayout())
        convert.hf_to_megatron(hf_dir, f"{root}/ckpt")
        convert.megatron_to_hf(f"{root}/ckpt", f"{root}/export", max_shard_size=64 << 10)
        model, hf = convert.load_model(hf_dir)
        convert.export_to_hf_dir(model, hf, f"{root}/final", 5 * 10**9, assets_dir=hf_dir)  # train.py's finish
        streamed = [n for bucket in export_hf_weights(model, 48 << 10) for n, _ in bucket]
        destroy_distributed()
        out[root] = dict(streamed=streamed, stored=os.path.isfile(f"{root}/ckpt/hf_assets/carried.safetensors"))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (tiny transformers model, its MTP tensor names, its HF directory, the case's root, the rank's
    result): every case converted in one spawned rank."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    cases = {}
    for kind, extra in CASES.items():
        root = tmp_path_factory.mktemp(kind)
        hf_dir = str(root / "hf")
        model = save_tiny_hf_model(kind, hf_dir, seed=11, **extra)
        cfg = model.config
        added = add_mtp_layer(hf_dir, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
        cases[kind] = (model, added, hf_dir, root, _tensors(hf_dir))
    (results,) = run_ranks(convert_export_stream, 1, [(c[2], str(c[3])) for c in cases.values()])
    return {kind: (*c, results[str(c[3])]) for kind, c in cases.items()}


@pytest.mark.parametrize("kind", list(CASES))
def test_mtp_layers_carried_bitwise_and_never_synced(converted, kind):
    import json

    from gspo_megatron.models.carried import mtp_names

    model, added, hf_dir, tmp_path, original, r = converted[kind]
    with open(f"{hf_dir}/config.json") as f:
        hf = json.load(f)
    assert mtp_names(hf, original) == added and len(added) > 10
    assert r["stored"]
    assert r["streamed"] and not set(r["streamed"]) & set(added)  # the weight sync never sends them
    assert set(r["streamed"]) == set(original) - set(added)
    for out in ("export", "final"):
        exported = _tensors(str(tmp_path / out))
        assert sorted(exported) == sorted(original), out
        for name, t in original.items():
            assert exported[name].dtype == t.dtype and exported[name].shape == t.shape, (out, name)
            assert torch.equal(exported[name].view(torch.uint8), t.view(torch.uint8)), (out, name)
    with open(tmp_path / "export" / "model.safetensors.index.json") as f:
        assert set(added) <= set(json.load(f)["weight_map"])
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    ids = torch.tensor([list(range(3, 20))])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model.float()(ids).logits)
