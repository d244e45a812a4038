"""``tools/megatron_to_hf.py --lora-format peft`` (gspo_megatron/models/lora_peft.py) on a tiny Qwen2-MoE
LoRA checkpoint written at tp2 (adapters on the fused linear_qkv, linear_proj, the shared expert's and
the dense layer's fused fc1 (gate_up) and fc2): the PEFT names and shapes against the merged export and transformers' own modules,
and per HF module ``W_merged == W_base + (alpha / r) B @ A`` from the PEFT files and the base HF
checkpoint (fp32 rounding); routed-expert adapters are refused with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distributed_harness import run_ranks
from lora_checkpoint_workers import lora_adapter_checkpoint_job

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL = os.path.join(REPO, "tools", "megatron_to_hf.py")
TARGETS = [
    "linear_qkv",
    "linear_proj",
    "shared_experts.linear_fc1",
    "shared_experts.linear_fc2",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
]  # every linear but the routed experts (layer 1 of the tiny model is dense)


def _tool(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, TOOL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("peft")
    save_tiny_hf_model("qwen2_moe", str(root / "hf"), seed=4, num_hidden_layers=2)
    run_ranks(lora_adapter_checkpoint_job, 2, str(root / "hf"), str(root / "ckpt"), TARGETS)
    for fmt in ("merged", "peft"):
        proc = _tool(
            "--checkpoint",
            str(root / "ckpt"),
            "--output",
            str(root / fmt),
            "--lora-format",
            fmt,
            *(["--base-model", str(root / "hf")] if fmt == "peft" else []),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_peft_names_shapes_and_merge(dirs):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((dirs / "peft" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 8)
    assert cfg["base_model_name_or_path"] == str(dirs / "hf")
    attn = [f"self_attn.{p}_proj" for p in "qkvo"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    want = sorted(
        [f"model.layers.{i}.{m}" for i in range(2) for m in attn]
        + [f"model.layers.0.mlp.shared_expert.{m}" for m in mlp]
        + [f"model.layers.1.mlp.{m}" for m in mlp]
    )
    assert cfg["target_modules"] == want
    peft = _load(dirs / "peft" / "adapter_model.safetensors")
    assert sorted(peft) == sorted(f"base_model.model.{m}.lora_{x}.weight" for m in want for x in "AB")
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(str(d / f), "pt") as h:
                    out.update({k: h.get_tensor(k) for k in h.keys()})
        return out

    merged, base = tensors(dirs / "merged"), tensors(dirs / "hf")
    assert sorted(merged) == sorted(base)
    hf_modules = dict(AutoModelForCausalLM.from_pretrained(str(dirs / "hf")).named_modules())
    s = cfg["lora_alpha"] / cfg["r"]
    worst = 0.0
    for m in want:
        A, B = peft[f"base_model.model.{m}.lora_A.weight"], peft[f"base_model.model.{m}.lora_B.weight"]
        W = merged[f"{m}.weight"]
        assert A.shape == (4, W.shape[1]) and B.shape == (W.shape[0], 4), m
        assert isinstance(hf_modules[m], torch.nn.Linear) and tuple(hf_modules[m].weight.shape) == tuple(W.shape)
        expect = (base[f"{m}.weight"].float() + s * (B.float() @ A.float())).to(W.dtype)
        worst = max(worst, (W - expect).abs().max().item())
        torch.testing.assert_close(W, expect, rtol=0, atol=1e-6)
        assert not torch.equal(W, base[f"{m}.weight"]), m  # the adapters are not zero
    print(f"max |W_merged - (W_base + s B A)| over {len(want)} modules: {worst:.3g}")
    for i in range(2):  # the fused column-parallel bases share A across their HF parts
        a = [peft[f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_A.weight"] for p in "qkv"]
        assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    untouched = [k for k in base if not any(k == f"{m}.weight" for m in want)]
    assert untouched and all(torch.equal(merged[k], base[k]) for k in untouched)  # frozen base, no adapter


def test_peft_refuses_routed_experts_and_multi_rank(dirs, tmp_path):
    run_ranks(lora_adapter_checkpoint_job, 1, str(dirs / "hf"), str(tmp_path / "ckpt"), None)
    proc = _tool("--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"), "--lora-format", "peft")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith("megatron_to_hf: error: --lora-format peft:"), proc.stderr[-3000:]
    assert "routed experts" in line and "target_parameters" in line and "--lora-format merged" in line, line
    plain = tmp_path / "plain"
    proc = _tool("--checkpoint", str(dirs / "ckpt"), "--output", str(plain), "--lora-format", "peft", "--tp", "2")
    assert proc.returncode == 2 and "one process" in proc.stderr, proc.stderr[-3000:]


def test_peft_adapter_loads_in_transformers_and_peft(dirs):
    """The exported adapter directory as a user loads it: transformers' base model plus
    ``peft.PeftModel.from_pretrained`` gives the log-probs of the merged export (which is the trainer's
    ``W + (alpha / r) B A``), every adapter matched to a module (peft warns and skips names it cannot place,
    so the adapted logits must also differ from the base's)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    load = lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        merged = load(dirs / "merged")(ids).logits.log_softmax(-1)
        base_model = load(dirs / "hf")
        base = base_model(ids).logits.log_softmax(-1)
        adapted_model = peft.PeftModel.from_pretrained(base_model, str(dirs / "peft")).eval()
        adapted = adapted_model(ids).logits.log_softmax(-1)
    n_lora = sum(1 for n, _ in adapted_model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    n_file = len(_load(dirs / "peft" / "adapter_model.safetensors"))
    assert n_lora == n_file, (n_lora, n_file)
    assert (adapted - base).abs().max() > 1e-4  # the adapters do something
    assert torch.allclose(adapted, merged, atol=1e-5, rtol=0), (adapted - merged).abs().max()
