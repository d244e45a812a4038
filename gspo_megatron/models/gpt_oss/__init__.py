"""gpt-oss (gpt-oss-20b / gpt-oss-120b; HF ``model_type`` gpt_oss): GQA with q/k/v/o biases and
per-head attention sinks, sliding-window attention on the layers ``layer_types`` marks
``sliding_attention`` (window ``sliding_window``; transformers: key j visible from query i when
i - W < j <= i), YaRN RoPE, and MoE in every layer: a router with a bias (top-k of the logits, then
softmax over those k), experts with biases and the clamped SwiGLU
``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, g = clamp(gate, max=l).

Megatron-Core 0.16.1 pieces (local spec), each equal to transformers' computation:
- sinks: ``softmax_type="learnable"``: DotProductAttention's ``softmax_offset`` [heads/TP] is
  appended as one more logit per row before the softmax and dropped after it (SoftmaxOne), as
  transformers' eager attention does. Megatron leaves that parameter without the tensor-parallel
  attribute, so TP ranks would count it as a duplicate in the gradient norm; ``local_spec.py``
  marks it TP-split;
- sliding window: ``window_size=(W - 1, 0)`` with ``window_attn_skip_freq`` listing the sliding
  layers (1) per layer;
- YaRN: ``models/yarn.py`` (with ``truncate``);
- biases: ``add_bias_linear`` (attention out, expert fc1/fc2, router bias) + ``add_qkv_bias``; an
  expert's fc2 bias is scaled by its routing weight, as in transformers. Megatron-Core allows expert
  biases only with expert tensor parallel size 1 (``parallel.etp=1``; refused otherwise, one line),
  and its in-place bias add fails under autograd on the local spec (``local_spec.py`` fixes it);
- clamped SwiGLU: ``activation_func_clamp_value=l``, ``glu_linear_offset=1``, activation
  ``x * sigmoid(alpha x)`` (``quick_gelu`` for alpha 1.702), non-fused
  (``bias_activation_fusion=False``: the fused kernel ignores neither, but is CUDA-only);
- routing: softmax score, top-k before the softmax (``moe_router_pre_softmax=False``).
Checkpoint layout: experts stacked per layer (``mlp.experts.gate_up_proj`` [E, H, 2I] with gate/up
interleaved, ``down_proj`` [E, I, H], their biases), as transformers saves them: ``rules.
stacked_expert_rules``.

Refused (one line naming the field): ``attention_bias=false`` (Megatron's ``add_bias_linear`` would
also drop the expert biases), a ``quantization_config`` (the published MXFP4 weights: dequantize to
bf16 first, e.g. load with transformers and save_pretrained), ``layer_types`` other than
sliding/full, and Transformer Engine (its sink and grouped-expert-bias mapping is not written nor
verified yet: ``model.transformer_impl=local``). The planner counts the KV cache of every layer at
full length (the sliding layers need only the window): an over-estimate.
"""

from __future__ import annotations

import functools

import torch

from gspo_megatron.models import hf_config
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.mapping import MappingRegistry
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import (
    StackedExpertNaming,
    attention_out_bias_rule,
    attention_sink_rule,
    embedding_rules,
    gqa_attention_rules,
    pre_mlp_norm_rules,
    stacked_expert_rules,
)


def sigmoid_gated(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """x * sigmoid(alpha * x): gpt-oss's GLU activation (quick_gelu when alpha = 1.702)."""
    return x * torch.sigmoid(alpha * x)


@register_family
class GptOss(GQAFamily):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    sglang_modules = {"GptOssForCausalLM": "gpt_oss"}
    expert_naming = None  # experts are stacked in the checkpoint, as in memory (no per-expert names)
    stacked_expert_naming = StackedExpertNaming("mlp", "gate_up_proj", "down_proj")
    fp8_modules = ("q_proj", "k_proj", "v_proj", "o_proj")  # 2-D weights; stacked experts stay as they are
    fp8_excluded = GQAFamily.fp8_excluded + ("router", "sinks")
    # the stacked experts are synced in bf16: an FP8 engine must not give them Fp8MoEMethod
    fp8_engine_unquantized = ("mlp.experts",)
    tiny = dict(
        architectures=["GptOssForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=0.1,
        swiglu_alpha=1.702,  # a limit the tiny activations cross: the clamp acts
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=16,
        ),
    )

    published = {
        "gpt-oss-120b": {  # openai/gpt-oss-120b (MXFP4 experts on disk: dequantize to bf16 first)
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": 200002,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2880,
            "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
            "max_position_embeddings": 131072,
            "model_type": "gpt_oss",
            "num_attention_heads": 64,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "num_local_experts": 128,
            "output_router_logits": False,
            "pad_token_id": 199999,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "rope_theta": 150000,
            "router_aux_loss_coef": 0.9,
            "sliding_window": 128,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 201088,
        },
    }

    def has_qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("attention_bias", True))

    def check(self, hf: dict) -> None:
        def no(cond, msg):
            if cond:
                raise ValueError(f"config.json {msg} is not supported for {self.name}")

        no(not hf.get("attention_bias", True), "attention_bias=false")
        no(
            hf.get("quantization_config") is not None,
            "quantization_config (quantized experts: dequantize to bf16 first)",
        )
        kinds = set(self.layer_types(hf))
        no(not kinds <= {"sliding_attention", "full_attention"}, f"layer_types {sorted(kinds)}")
        kind = hf_config.rope_type(hf)
        no(kind not in ("default", "yarn"), f"rope type {kind!r}")
        if kind == "yarn":
            from gspo_megatron.models.yarn import yarn_fields

            yarn_fields(hf, self.name)

    def check_transformer_impl(self, te: bool) -> None:
        if te:
            raise ValueError(
                f"{self.name} (attention sinks, stacked biased experts) runs on Megatron's local "
                "layer spec only for now: set model.transformer_impl=local"
            )

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        if not te:
            from gspo_megatron.models.gpt_oss.local_spec import adapt_local_spec

            adapt_local_spec(block_spec)

    def randomize_tiny(self, model) -> None:
        """Sinks, router weight and bias, expert and attention biases: random and large enough to matter
        (transformers starts the biases at zero and the rest at std 0.02)."""
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.sinks", "mlp.router.weight", "mlp.router.bias")):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith(("gate_up_proj_bias", "down_proj_bias", "_proj.bias")):
                p.copy_(torch.randn_like(p) * 0.1)

    def check_layout(self, hf: dict, tp: int, pp: int, ep: int, etp: int | None) -> None:
        etp = tp if etp is None else etp
        if etp > 1:
            raise ValueError(
                f"parallel.etp={etp}: {self.name}'s expert biases need expert tensor parallel "
                "size 1 in Megatron-Core: set parallel.etp=1"
            )

    def layer_types(self, hf: dict) -> list[str]:
        n = hf_config.get_int(hf, "num_hidden_layers")
        types = hf.get("layer_types")
        if types is None:  # transformers' default: sliding on even layers
            return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(types) != n:
            raise ValueError(f"config.json layer_types has {len(types)} entries for {n} layers")
        return list(types)

    # -- Megatron config ------------------------------------------------------------------------
    def config_fields(self, hf: dict) -> dict:
        fields = super().config_fields(hf)
        alpha = float(hf.get("swiglu_alpha", 1.702))
        sliding = [int(t == "sliding_attention") for t in self.layer_types(hf)]
        window = hf.get("sliding_window")
        fields.update(
            ffn_hidden_size=hf_config.get_int(hf, "intermediate_size"),
            add_bias_linear=True,
            add_qkv_bias=True,
            softmax_type="learnable",
            activation_func=_activation(alpha),
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
            bias_activation_fusion=False,
            moe_router_pre_softmax=False,
        )
        if window and any(sliding):
            fields.update(window_size=(int(window) - 1, 0), window_attn_skip_freq=sliding)
        return fields

    def moe_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "intermediate_size")

    # -- weights ----------------------------------------------------------------------------------
    def mapping(self, hf: dict) -> MappingRegistry:
        rules = embedding_rules(hf) + gqa_attention_rules(hf) + [attention_out_bias_rule(), attention_sink_rule()]
        rules += pre_mlp_norm_rules() + stacked_expert_rules(self.stacked_expert_naming)
        return MappingRegistry(rules)

    # -- planner ----------------------------------------------------------------------------------
    def dims(self, hf: dict) -> ModelDims:
        g = hf_config.get_int
        n = g(hf, "num_hidden_layers")
        return ModelDims(
            model_type=self.name,
            vocab_size=g(hf, "vocab_size"),
            hidden=g(hf, "hidden_size"),
            num_layers=n,
            num_heads=hf_config.num_heads(hf),
            num_kv_heads=hf_config.num_kv_heads(hf),
            head_dim=hf_config.head_dim(hf),
            ffn_hidden=0,
            moe_ffn_hidden=g(hf, "intermediate_size"),
            num_experts=hf_config.num_experts(hf),
            topk=g(hf, "num_experts_per_tok"),
            moe_layers=tuple(range(n)),
            qk_norm=False,
            qkv_bias=True,
            o_bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 1 << 30),
            rope_type=hf_config.rope_type(hf),
            expert_bias=True,
            router_bias=True,
            attention_sinks=True,
        )


def _activation(alpha: float):
    from megatron.core.activations import quick_gelu

    return quick_gelu if alpha == 1.702 else functools.partial(sigmoid_gated, alpha=alpha)
