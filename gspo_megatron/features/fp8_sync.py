"""``rollout.sync_fp8``: the engines serve block-wise FP8 weights (``wire_format.FP8_BLOCK`` squares,
one float32 ``weight_scale_inv`` each) quantized by the trainer at every sync
(``weight_sync/fp8_quant.py``); the engines start from a config that names the quantization
(``engines/engine_model.py``)."""

from __future__ import annotations

from gspo_megatron.features.base import Feature


def engine_param_bytes(cfg) -> int:
    """Bytes per parameter of the engines' weights (and of every copy of what they are sent): 1 in FP8,
    2 in bf16."""
    return 1 if cfg.rollout.sync_fp8 else 2


class Fp8Sync(Feature):
    name = "fp8_sync"
    field = "rollout.sync_fp8"

    def enabled(self, cfg) -> bool:
        return bool(cfg.rollout.sync_fp8)

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        if not r.sync_fp8:
            return []
        e = []
        if r.engine == "hf":
            e.append("rollout.sync_fp8 needs rollout.engine=sglang")
        if r.engine_urls:
            e.append(
                "rollout.sync_fp8=true is not supported with rollout.engine_urls (attached engines): they start "
                "from the bf16 checkpoint (launch/sglang_node.sh) without the FP8 quantization_config the trainer "
                "gives the engines it launches, so SGLang would skip the weight_scale_inv tensors and load e4m3 "
                "bytes into bf16 weights; set rollout.sync_fp8=false, or rollout.engine_urls=[] and "
                "rollout.num_engines=N to let the trainer launch them"
            )
        if r.engine == "sglang" and r.engine_server == "cpu":
            e.append(
                "rollout.sync_fp8=true is not supported with rollout.engine_server=cpu: the CPU stand-in server "
                "does not read the engine's FP8 quantization_config, so it would skip the weight_scale_inv tensors "
                "and load e4m3 bytes into float weights; set rollout.sync_fp8=false (or rollout.engine_server=sglang "
                "on GPUs)"
            )
        return e


FP8_SYNC = Fp8Sync()
