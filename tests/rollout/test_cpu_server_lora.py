"""LoRA adapters on the CPU server (cpu_server/lora.py): sglang 0.5.23's ``/load_lora_adapter_from_tensors``
and ``/unload_lora_adapter`` (request / response fields, HTTP 400 with the result on failure), its
refusals (already loaded, rank over ``--max-lora-rank``, a target outside ``--lora-target-modules``,
DoRA, added tokens, unknown / unloaded ``lora_path``, not enabled, ``dp_size`` > 1), its server-arg
checks, and generation: a request with ``lora_path`` is served by ``W + s B A`` (equal to transformers
with the adapter merged), one without by the bare base, both in one batch."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from cpu_server_util import CpuServer
from gspo_megatron.engines.sglang_compat import multiprocessing_serializer, use_cpu_shared_memory

TP = 2
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = CpuServer(
        model_dir,
        str(tmp_path_factory.mktemp("logs")),
        tp=TP,
        extra=(
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            *TARGETS,
            "--max-loras-per-batch",
            "2",
            "--max-loaded-loras",
            "3",
        ),
    )
    yield s
    s.stop()


def post(url: str, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{url}/{route}", data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def adapter(saved: dict, seed: int, rank: int = RANK, modules=TARGETS) -> dict[str, torch.Tensor]:
    """PEFT-named A [r, in] and B [out, r] for every attention linear of the checkpoint."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in saved.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in modules or not name.endswith(".weight"):
            continue
        mod = name[: -len(".weight")]
        out[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.3
        out[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.3
    return out


def config(rank: int = RANK, modules=TARGETS, **extra) -> dict:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "target_modules": list(modules), **extra}


def load(url: str, name: str, tensors: dict, cfg: dict, **extra) -> tuple[int, dict]:
    use_cpu_shared_memory()
    payloads = [multiprocessing_serializer().serialize(dict(tensors), output_str=True) for _ in range(TP)]
    return post(
        url,
        "load_lora_adapter_from_tensors",
        {"lora_name": name, "config_dict": cfg, "serialized_named_tensors": payloads, **extra},
    )


def merged_logprobs(model_dir: str, saved: dict, tensors: dict | None, prompt: list[int], out_ids: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    state = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in (tensors or {}).items():
            if ".lora_A." in k:
                b = tensors[k.replace(".lora_A.", ".lora_B.")]
                w = state[k.split(".lora_A.")[0][len("base_model.model.") :] + ".weight"]
                w.copy_((w.float() + ALPHA / RANK * (b.float() @ a.float())).to(w.dtype))
        logits = model(torch.tensor([prompt + out_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]


def generate(url: str, prompts: list[list[int]], lora_path=None) -> tuple[int, object]:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "return_logprob": True}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return post(url, "generate", body)


def test_load_serve_unload(server, model_dir, saved):
    url = server.url
    tensors = adapter(saved, 0)
    status, out = load(url, "a", tensors, config())
    assert status == 200 and out == {"success": True, "error_message": "", "loaded_adapters": {"a": "__tensor__"}}, out
    prompt = [5, 17, 42, 9, 3]
    status, outs = generate(url, [prompt, prompt], lora_path=["a", None])
    assert status == 200, outs
    for out, lora in zip(outs, [tensors, None]):
        ids = out["output_ids"]
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        want = merged_logprobs(model_dir, saved, lora, prompt, ids)
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4, (lora is not None, got, want)
    # the adapter changes the model (a base-only answer differs from the adapter's)
    assert outs[0]["meta_info"]["output_token_logprobs"] != outs[1]["meta_info"]["output_token_logprobs"]
    status, single = generate(url, [prompt], lora_path="a")
    assert (
        status == 200
        and single[0]["meta_info"]["output_token_logprobs"] == outs[0]["meta_info"]["output_token_logprobs"]
    )

    # refusals (sglang's texts)
    status, out = load(url, "a", tensors, config())
    assert status == 400 and not out["success"], out
    assert out["error_message"] == "Failed to load LoRA adapter a because it is already loaded", out
    status, out = load(url, "big", adapter(saved, 1, rank=16), config(rank=16))
    assert status == 400 and "with rank 16 is incompatible" in out["error_message"], out
    status, out = load(url, "mlp", adapter(saved, 1), config(modules=TARGETS + ["gate_proj"]))
    assert status == 400 and "`--lora-target-modules`" in out["error_message"], out
    status, out = load(url, "dora", adapter(saved, 1), config(use_dora=True))
    assert status == 400 and "doesn't support DoRA adapters" in out["error_message"], out
    status, out = load(url, "tok", adapter(saved, 1), config(), added_tokens_config={"<new>": 10**6})
    assert status == 400 and "add tokens to the vocabulary" in out["error_message"], out
    status, out = generate(url, [prompt], lora_path="nope")
    assert status == 400 and out["error"]["message"].startswith("Got LoRA adapter that has never been loaded: nope"), (
        out
    )

    # rotation: load b, unload a; a request for a is refused, b serves
    status, out = load(url, "b", adapter(saved, 2), config())
    assert status == 200 and out["loaded_adapters"] == {"a": "__tensor__", "b": "__tensor__"}, out
    status, out = post(url, "unload_lora_adapter", {"lora_name": "a"})
    assert status == 200 and out["success"] and out["loaded_adapters"] == {"b": "__tensor__"}, out
    status, out = generate(url, [prompt], lora_path="a")
    assert status == 400 and "Failed to implicitly load LoRA adapter a" in out["error"]["message"], out
    status, out = post(url, "unload_lora_adapter", {"lora_name": "a"})
    assert status == 400 and out["error_message"].startswith("LoRA with name a does not exist"), out
    status, out = load(url, "a", tensors, config())  # a name unloaded may be loaded again
    assert status == 200, out
    status, again = generate(url, [prompt], lora_path="a")
    assert (
        status == 200
        and again[0]["meta_info"]["output_token_logprobs"] == outs[0]["meta_info"]["output_token_logprobs"]
    )
    status, out = post(url, "unload_lora_adapter", {})
    assert status == 422, out


def test_front_refusals_without_lora_and_with_dp():
    from gspo_megatron.cpu_server.args import parse_args
    from gspo_megatron.cpu_server.lora import FrontLoras

    front = FrontLoras(parse_args(["--model-path", "x"]))
    status, out = front.load({"lora_name": "a", "config_dict": {}, "serialized_named_tensors": []}, None)
    assert status == 400 and out == {
        "success": False,
        "loaded_adapters": None,
        "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
    }
    assert front.resolve(["a"]).startswith("LoRA adapter 'a' was requested, but LoRA is not enabled.")
    assert front.resolve([None]) is None
    dp = FrontLoras(
        parse_args(
            [
                "--model-path",
                "x",
                "--enable-lora",
                "--max-lora-rank",
                "8",
                "--lora-target-modules",
                "all",
                "--dp-size",
                "2",
            ]
        )
    )
    status, out = dp.load({"lora_name": "a", "config_dict": {}, "serialized_named_tensors": []}, None)
    assert (
        status == 500 and out["error"]["message"] == "data-parallel replicas are not supported for dynamic lora loading"
    )


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--enable-lora"], "you need to specify both --max-lora-rank and --lora-target-modules"),
        (
            ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"],
            "should be the only module",
        ),
        (
            ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "--max-loaded-loras", "2"],
            "max_loaded_loras should be greater than or equal to max_loras_per_batch",
        ),
        (["--lora-target-modules", "linear_qkv"], "invalid choice: 'linear_qkv'"),
    ],
)
def test_lora_server_args_refused(argv, msg, capsys):
    from gspo_megatron.cpu_server.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "x", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_routed_expert_adapter_applied_per_expert(model_dir, saved, tmp_path):
    """sglang's per-expert routed-expert adapter (``...mlp.experts.<e>.{gate,up,down}_proj.lora_A/B.weight``,
    what ``rollout.lora_sync=adapter`` sends for ``experts.linear_fc1`` / ``linear_fc2`` targets), through
    sglang's LoRAAdapter normalization (gate/up stacked into ``experts.<e>.gate_up_proj``): applied on
    transformers' fused 3-D expert parameters, it gives the logits of the checkpoint merged per expert
    (``W_e + s B_e A_e`` written into a copy of the checkpoint and loaded by transformers), and the base
    is restored after."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    modules = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    tensors = adapter(saved, 5, modules=modules)
    assert any(".mlp.experts.3.down_proj.lora_B." in k for k in tensors)
    loras = _worker_loras(model_dir, modules)
    use_cpu_shared_memory()
    payload = multiprocessing_serializer().serialize(dict(tensors), output_str=True)
    out = loras.load(0, "moe", config(modules=modules), [payload])
    assert out["success"], out
    assert any(".experts.0.gate_up_proj.lora_A" in k for k in loras.adapters["moe"]["weights"])  # sglang stacked it

    merged = dict(saved)
    for k, a in tensors.items():
        if ".lora_A." in k:
            w = k.split(".lora_A.")[0][len("base_model.model.") :] + ".weight"
            b = tensors[k.replace(".lora_A.", ".lora_B.")]
            merged[w] = (merged[w].float() + ALPHA / RANK * (b.float() @ a.float())).to(merged[w].dtype)
    ref_dir = tmp_path / "merged"
    shutil.copytree(model_dir, ref_dir)
    save_file(merged, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([[5, 17, 42, 9, 3, 11, 60, 2]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(ref_dir), torch_dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        base = model(ids).logits
        with loras.applied("moe", model):
            got = model(ids).logits
        want = ref(ids).logits
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the base restored
    assert (got - want).abs().max().item() < 1e-5, (got - want).abs().max().item()
    assert (got - base).abs().max().item() > 1e-3  # the experts' adapters change the output


def test_load_from_path(server, model_dir, saved, tmp_path):
    """``POST /load_lora_adapter`` with a PEFT directory (adapter_config.json + adapter_model.safetensors,
    what ``rollout.lora_sync=adapter`` writes for engines on other hosts): served like the same adapter
    loaded from tensors; a missing directory is refused; unload works as for tensors."""
    from safetensors.torch import save_file

    tensors = adapter(saved, 9)
    d = tmp_path / "peft"
    d.mkdir()
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(config()))
    status, out = post(server.url, "load_lora_adapter", {"lora_name": "p", "lora_path": str(d)})
    assert status == 200 and out["success"] and out["loaded_adapters"]["p"] == str(d), out
    prompt = [5, 17, 42, 9, 3]
    status, outs = generate(server.url, [prompt], lora_path="p")
    assert status == 200, outs
    got = [x[0] for x in outs[0]["meta_info"]["output_token_logprobs"]]
    want = merged_logprobs(model_dir, saved, tensors, prompt, outs[0]["output_ids"])
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4, (got, want)
    status, out = post(server.url, "load_lora_adapter", {"lora_name": "q", "lora_path": str(tmp_path / "nope")})
    assert status == 400 and "not one" in out["error_message"], out
    status, out = post(server.url, "unload_lora_adapter", {"lora_name": "p"})
    assert status == 200 and "p" not in out["loaded_adapters"], out


def _worker_loras(model_dir: str, server_targets: list[str]):
    """One TP rank's LoRA state of a CPU server started with ``--lora-target-modules server_targets``."""
    from transformers import AutoConfig

    from gspo_megatron.cpu_server.args import parse_args
    from gspo_megatron.cpu_server.lora import WorkerLoras

    args = parse_args(
        ["--model-path", model_dir, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *server_targets]
    )
    return WorkerLoras(args, AutoConfig.from_pretrained(model_dir))


@pytest.mark.parametrize(
    "server_targets, kept",
    [
        (["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], False),  # no down_proj: the MoE layer unwrapped
        (["q_proj", "k_proj", "v_proj", "gate_up_proj", "down_proj"], True),
        (["all"], True),
    ],
)
def test_moe_layer_wrapped_only_with_gate_up_and_down(model_dir, saved, server_targets, kept):
    """sglang 0.5.23 wraps a FusedMoE with LoRA only when both gate_up_proj and down_proj are among
    --lora-target-modules (lora_manager.py init_lora_modules); otherwise the experts' adapters are
    dropped without an error, the adapter still loads (its targets are within the server's). The CPU
    server drops them the same way: only the attention adapters are applied."""

    modules = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    tensors = adapter(saved, 6, modules=modules)
    assert any(".mlp.experts.0.gate_proj.lora_A." in k for k in tensors)
    loras = _worker_loras(model_dir, server_targets)
    use_cpu_shared_memory()
    out = loras.load(0, "moe", config(modules=modules), [multiprocessing_serializer().serialize(dict(tensors))])
    assert out["success"], out
    names = list(loras.adapters["moe"]["weights"])
    assert any(".self_attn.qkv_proj.lora_A" in n for n in names)
    assert any(".experts." in n for n in names) == kept, names
