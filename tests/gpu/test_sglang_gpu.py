"""GPU tests: SGLang generation and both weight-sync modes end to end with a tiny random HF model.

Run on a GPU node with sglang installed: ``pytest -m gpu tests/gpu``. Skipped on CPU (conftest).
The NCCL test needs two GPUs (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import socket

import pytest
import torch

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (head_dim 64, bf16) saved in HF format; no tokenizer needed
    (engines run with skip_tokenizer_init and take token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()


def _engine(path, **kw):
    from gspo_megatron.rollout.sglang_engine import SGLangRolloutEngine

    args = dict(model_path=path, skip_tokenizer_init=True, mem_fraction_static=0.3, random_seed=0,
                disable_cuda_graph=True, log_level="error")
    args.update(kw)
    return SGLangRolloutEngine.in_process(**args)


@torch.no_grad()
def _hf_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()


def test_generation_returns_g_samples_with_trainer_matching_logprobs(tiny_model_dir):
    from gspo_megatron.rollout.base import SamplingParams

    engine = _engine(tiny_model_dir)
    try:
        prompts = [[1, 5, 9, 13], [1, 7]]
        params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=1234)
        out = engine.generate(prompts, n=3, params=params)
        assert [len(g) for g in out] == [3, 3]
        hf = _hf_model(tiny_model_dir)
        for p, group in zip(prompts, out):
            for s in group:
                assert s.prompt_ids == p and len(s.response_ids) == len(s.response_logprobs) > 0
                assert s.finish_reason in ("stop", "length")
                ref = _hf_logprobs(hf, p, s.response_ids, params.temperature)
                torch.testing.assert_close(torch.tensor(s.response_logprobs), ref, atol=0.1, rtol=0.05)
        again = engine.generate(prompts, n=3, params=params)  # per-sample seeds -> reproducible
        assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in out]
        assert engine.health_check()
    finally:
        engine.shutdown()


def _perturbed_state(path, scale=0.05):
    torch.manual_seed(1)
    model = _hf_model(path)
    sd = {k: (v + scale * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}
    return sd


def test_cuda_ipc_sync_then_verify_and_generate(tiny_model_dir):
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport
    from gspo_megatron.weight_sync.verify import WeightMismatchError, sample_names, verify_engine_prefixes

    engine = _engine(tiny_model_dir, enable_memory_saver=True)
    try:
        new = _perturbed_state(tiny_model_dir)
        names = list(new)
        engine.release_memory()
        engine.resume_memory(["weights"])
        transport = CudaIpcTransport(engine.clients[0])
        transport.begin()
        for i in range(0, len(names), 4):  # several buckets
            transport.send_bucket([(n, new[n]) for n in names[i : i + 4]])
        transport.end()
        engine.resume_memory(["kv_cache"])
        m = transport.metrics()
        assert m["sync/buckets"] == -(-len(names) // 4) and m["sync/bytes"] > 0
        picked = {n: new[n] for n in sample_names(names, 6, seed=0)}
        verify_engine_prefixes(engine.weight_prefix, picked)
        old = _hf_model(tiny_model_dir).state_dict()
        with pytest.raises(WeightMismatchError):
            verify_engine_prefixes(engine.weight_prefix, {"model.layers.0.mlp.down_proj.weight":
                                                          old["model.layers.0.mlp.down_proj.weight"]})
        # greedy generation now follows the new weights
        hf = _hf_model(tiny_model_dir)
        hf.load_state_dict(new)
        out = engine.generate([[1, 5, 9]], n=1, params=SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8))
        ids = torch.tensor([[1, 5, 9]], device="cuda")
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 3:].tolist()
        got = out[0][0].response_ids
        assert got == ref[: len(got)]
    finally:
        engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs the engine on another GPU")
def test_nccl_broadcast_sync_end_to_end(tiny_model_dir):
    from gspo_megatron.weight_sync.nccl_broadcast import NcclBroadcastTransport, pp_group_name
    from gspo_megatron.weight_sync.verify import sample_names, verify_engine_prefixes

    engine = _engine(tiny_model_dir, base_gpu_id=1)
    try:
        torch.cuda.set_device(0)
        new = _perturbed_state(tiny_model_dir, scale=0.1)
        names = list(new)
        t = NcclBroadcastTransport(engine.clients, engine_world_sizes=[1], master_address="127.0.0.1",
                                   master_port=_free_port(), group_name=pp_group_name(0), backend="nccl",
                                   device="cuda:0")
        t.begin()
        for i in range(0, len(names), 5):
            t.send_bucket([(n, new[n]) for n in names[i : i + 5]])
        t.end()
        verify_engine_prefixes(engine.weight_prefix, {n: new[n] for n in sample_names(names, 6, seed=1)})
        assert t.metrics()["sync/bytes"] == sum(v.numel() * v.element_size() for v in new.values())
        t.close()
    finally:
        engine.shutdown()
