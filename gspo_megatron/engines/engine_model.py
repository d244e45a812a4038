"""What an SGLang engine is started from: its model directory and extra server arguments, and the
checks of the engine's layout (``rollout.engine_tp`` / ``rollout.engine_ep``) against the model.

``prepare_engine_model_dir(cfg, hf_dir, out_dir) -> (model_path, extra_server_args)`` is called by
whoever launches an engine (the node that starts it; every node of a multi-node engine, since each
engine process reads the model path locally), before ``sglang.launch_server``:

- bf16 sync (``rollout.sync_fp8=false``): the engine starts from ``hf_dir`` itself;
  ``extra_server_args`` is empty (the flags that follow from the config alone, ``--ep-size`` among
  them, are ``fleet.engine_args.config_server_args``).
- FP8 sync (``rollout.sync_fp8=true``): the trainer sends the big projections as block-FP8
  (``weight_sync.fp8_quant``: ``<m>.weight`` e4m3 + ``<m>.weight_scale_inv`` fp32, 128 x 128 blocks).
  SGLang creates FP8 parameters and ``weight_scale_inv`` scales only when the model config says so;
  started from the bf16 config it has no parameter for the scales, skips them, and copies raw e4m3
  values into bf16 weights. So ``out_dir`` gets the HF ``config.json`` plus
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}`` (what sglang 0.5.23's ``Fp8Config.from_config`` reads: the
  block size makes it a block-quantized, fp8-serialized checkpoint, which it accepts only with
  ``activation_scheme: dynamic``), and the tokenizer / generation files of ``hf_dir`` (no weights).
  ``extra_server_args`` adds ``--load-format dummy``: SGLang's dummy loader fills the FP8 weights
  with small random values and the scales with 1.0; the trainer's first sync (before any rollout, and
  again after an engine restart) replaces every one of them. Modules the sync sends unquantized that
  sglang would otherwise build FP8 (the family's ``fp8_engine_unquantized``: gpt-oss's stacked experts,
  which ``quant_method: fp8`` alone gives ``Fp8MoEMethod``) are listed per layer in
  ``modules_to_not_convert`` (``Fp8Config.from_config`` reads it; ``get_quant_method`` then gives
  them ``UnquantizedFusedMoEMethod`` / ``UnquantizedLinearMethod``).
  Attached engines (``rollout.engine_urls``, ``launch/sglang_node.sh``) start from the bf16
  checkpoint, so FP8 sync with them is refused by the config checks.

``engine_model_errors(cfg, hf)`` lists what sglang's model class for the family builds differently
from the trainer (``ModelFamily.sglang_errors``: a tied lm_head it keeps apart, dense layers it
builds sparse), for every SGLang engine (the real server, the CPU stand-in, attached engines).

``engine_layout_errors(cfg, dims)`` lists what SGLang would refuse at start-up (read from sglang
0.5.23: ``moe_ep_setup.py``, ``Fp8LinearMethod.validate_block_quant_shapes``,
``Fp8MoEMethod.create_weights``), each error one line naming the fields; ``config.validate_model_layout``
calls it, so ``--check`` / ``--dry-run`` fail before anything starts:
- ``engine_ep`` must divide ``engine_tp`` and the number of experts, and needs an MoE model;
- an expert's intermediate size must split over ``moe_tp = engine_tp / engine_ep``;
- with FP8 sync, per engine rank: the expert intermediate size / moe_tp, the q / k / v output
  partitions, the dense MLP intermediate size / engine_tp, and (engine_tp > 1) the attention output
  projection's input must be multiples of 128 (the block size). E.g. Qwen3-30B-A3B
  (moe_intermediate_size 768) at engine TP8 gives 96: ``engine_ep`` 4 or 8 gives 384 or 768.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from gspo_megatron.wire_format import FP8_BLOCK as BLOCK

FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
# Files of an HF model directory that an engine started with --load-format dummy does not need.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _fp8_ep_choices(dims, tp: int) -> list[int]:
    return [
        ep
        for ep in range(1, tp + 1)
        if tp % ep == 0
        and dims.num_experts % ep == 0
        and dims.moe_ffn_hidden % (tp // ep) == 0
        and (dims.moe_ffn_hidden // (tp // ep)) % BLOCK == 0
    ]


def _experts_fp8(dims) -> bool:
    """Whether an FP8-on-sync engine builds the routed experts block-FP8 (not when the family keeps
    them unquantized: ``fp8_engine_unquantized``)."""
    from gspo_megatron.models.registry import family_for_model_type

    family = family_for_model_type(dims.model_type)
    return family is None or "mlp.experts" not in family.fp8_engine_unquantized


def engine_layout_errors(cfg, dims) -> list[str]:
    """What an SGLang engine of ``rollout.engine_tp`` x ``rollout.engine_ep`` cannot load.

    ``dims``: ``models.dims.ModelDims`` of the model. Returns one line per problem (empty: fine)."""
    r = cfg.rollout
    tp, ep = r.engine_tp, r.engine_ep
    e: list[str] = []
    if ep < 1 or tp % ep:
        return [f"rollout.engine_ep={ep} must divide rollout.engine_tp={tp} (SGLang's --ep-size divides --tp-size)"]
    if dims.num_experts == 0:
        if ep > 1:
            e.append(f"rollout.engine_ep={ep} needs an MoE model; {dims.model_type} has no experts")
    else:
        moe_tp = tp // ep
        if dims.num_experts % ep:
            e.append(f"rollout.engine_ep={ep} must divide the number of experts {dims.num_experts}")
        if dims.moe_ffn_hidden % moe_tp:
            e.append(
                f"rollout.engine_tp / rollout.engine_ep = {tp} / {ep} = {moe_tp} (SGLang's moe_tp_size) must "
                f"divide the expert intermediate size {dims.moe_ffn_hidden}"
            )
        elif r.sync_fp8 and _experts_fp8(dims) and (dims.moe_ffn_hidden // moe_tp) % BLOCK:
            choices = _fp8_ep_choices(dims, tp)
            hint = (
                f"; set rollout.engine_ep to one of {choices}"
                if choices
                else "; no engine_ep works at this engine_tp: change rollout.engine_tp or set rollout.sync_fp8=false"
            )
            e.append(
                f"rollout.sync_fp8: the expert intermediate size per engine rank, {dims.moe_ffn_hidden} / "
                f"(rollout.engine_tp / rollout.engine_ep) = {dims.moe_ffn_hidden} / ({tp} / {ep}) = "
                f"{dims.moe_ffn_hidden // moe_tp}, must be a multiple of {BLOCK} (SGLang's block-FP8 MoE){hint}"
            )
    if r.sync_fp8 and dims.num_heads % tp == 0:  # (heads not dividing engine_tp is refused elsewhere)
        # merged q/k/v: every output partition (also the o_proj input, = q) per rank
        q, kv = dims.num_heads // tp * dims.head_dim, max(1, dims.num_kv_heads // tp) * dims.head_dim
        if q % BLOCK or kv % BLOCK:
            e.append(
                f"rollout.sync_fp8: the attention q / k / v partitions per engine rank ({q} / {kv} / {kv} at "
                f"rollout.engine_tp={tp}, head_dim {dims.head_dim}) must be multiples of {BLOCK} "
                "(SGLang's block-FP8 linear layers)"
            )
    if r.sync_fp8 and dims.num_dense_layers and (dims.ffn_hidden % tp or (dims.ffn_hidden // tp) % BLOCK):
        e.append(
            f"rollout.sync_fp8: the dense MLP intermediate size per engine rank, intermediate_size / "
            f"rollout.engine_tp = {dims.ffn_hidden} / {tp}, must be a multiple of {BLOCK} "
            "(SGLang's block-FP8 linear layers)"
        )
    return e


def engine_model_errors(cfg, hf: dict) -> list[str]:
    """What an SGLang engine's model class would build differently from the trainer's model ``hf``
    (config.json as a dict): one line each (``ModelFamily.sglang_errors``); empty without SGLang."""
    from gspo_megatron.models.registry import get_family

    if cfg.rollout.engine != "sglang":
        return []
    return get_family(hf).sglang_errors(hf)


def fp8_quantization_config(hf: dict) -> dict:
    """The ``quantization_config`` an FP8-on-sync engine starts with (see the module docstring)."""
    from gspo_megatron.models import hf_config
    from gspo_megatron.models.registry import get_family

    q = dict(FP8_QUANTIZATION_CONFIG)
    keep = get_family(hf).fp8_engine_unquantized
    if keep:
        layers = hf_config.get_int(hf, "num_hidden_layers")
        q["modules_to_not_convert"] = [f"model.layers.{i}.{m}" for i in range(layers) for m in keep]
    return q


def engine_server_args(cfg) -> list[str]:
    """SGLang server arguments that go with the engine's model directory: ``--load-format dummy`` for
    an FP8-on-sync engine (the rest: ``fleet.engine_args.config_server_args``)."""
    return ["--load-format", "dummy"] if cfg.rollout.sync_fp8 else []


def _atomic_write_json(path: str, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def prepare_engine_model_dir(cfg, hf_dir: str, out_dir: str) -> tuple[str, list[str]]:
    """The model path and extra server arguments for one SGLang engine (see the module docstring).

    Raises ``errors.ConfigError`` (one line per problem) when the engine layout cannot load the model,
    ``FileNotFoundError`` when ``hf_dir`` has no config.json. Idempotent: several launchers (one per
    node of a multi-node engine) may write the same ``out_dir``; files are replaced atomically."""
    from gspo_megatron.errors import ConfigError
    from gspo_megatron.models.dims import ModelDims
    from gspo_megatron.models.hf_config import load_hf_config

    hf = load_hf_config(hf_dir)
    errors = engine_layout_errors(cfg, ModelDims.from_hf_config(hf)) + engine_model_errors(cfg, hf)
    if errors:
        raise ConfigError(errors)
    args = engine_server_args(cfg)
    if not cfg.rollout.sync_fp8:
        return hf_dir, args
    if hf.get("quantization_config"):
        raise ConfigError(
            f"rollout.sync_fp8: {hf_dir}/config.json already has a quantization_config "
            f"({hf['quantization_config'].get('quant_method')!r}); train from a bf16 checkpoint"
        )
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(hf_dir)):
        src = os.path.join(hf_dir, name)
        if (
            not os.path.isfile(src)
            or name == "config.json"
            or name in _WEIGHT_INDEXES
            or name.endswith(_WEIGHT_SUFFIXES)
            or name.startswith(".")
        ):
            continue
        shutil.copyfile(src, os.path.join(out_dir, name + ".tmp"))
        os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))
    from gspo_megatron.models.hf_config import file_config  # (a vision-language config: as its file holds it)

    _atomic_write_json(
        os.path.join(out_dir, "config.json"), {**file_config(hf), "quantization_config": fp8_quantization_config(hf)}
    )
    return out_dir, args
