"""GPU test: one FP8 training step through Transformer Engine with Megatron-Core's GPT model,
configured by ``runtime.fp8``. Needs TE and an FP8-capable GPU (compute capability >= 8.9)."""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.runtime.ports import free_port

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_step_runs_and_matches_bf16_loss(recipe):
    pytest.importorskip("transformer_engine")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gspo_megatron.runtime.fp8 import FP8Options, check_fp8_runtime

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)

    def build(opts: FP8Options):
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                                use_cpu_initialization=True, **opts.transformer_config_kwargs())
        return GPTModel(cfg, get_gpt_layer_with_transformer_engine_spec(), vocab_size=256,
                        max_sequence_length=64).cuda()

    opts = FP8Options.from_mapping({"fp8": "hybrid", "recipe": recipe, "amax_history_len": 16})
    check_fp8_runtime(opts)
    tokens = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda")[None].expand(2, -1)
    losses = {}
    for name, o in (("bf16", FP8Options()), ("fp8", opts)):
        model = build(o)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        optim.step()
        assert torch.isfinite(loss)
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        losses[name] = loss.item()
    # same init and data: FP8 rounding changes the loss only slightly
    assert abs(losses["fp8"] - losses["bf16"]) < 0.05 * abs(losses["bf16"])
    parallel_state.destroy_model_parallel()
