"""CPU checks of the GPU runtime helpers: the NVML monitor is a silent no-op here (and computes the
right numbers from a fake NVML), and the FP8 config maps onto real Megatron-Core fields."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from gspo_megatron.runtime.fp8 import FP8Options, check_fp8_runtime
from gspo_megatron.runtime.gpu_monitor import GpuMonitor


def test_monitor_is_a_quiet_noop_without_gpu():
    m = GpuMonitor()  # real pynvml (if installed) raises NVMLError_LibraryNotFound here
    assert m.enabled is False
    assert m.sample() == {}
    m.close()
    m.close()


def _fake_pynvml(fail_init=False, fail_query=False):
    mod = types.ModuleType("pynvml")
    mem = {0: (2 * 1024**3, 80 * 1024**3), 1: (6 * 1024**3, 80 * 1024**3), 2: (1 * 1024**3, 80 * 1024**3)}
    util = {0: 10.0, 1: 90.0, 2: 50.0}

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def mem_info(h):
        if fail_query:
            raise NVMLError("GPU is lost")
        return types.SimpleNamespace(used=mem[h][0], total=mem[h][1])

    mod.NVMLError = NVMLError
    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: 3
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetMemoryInfo = mem_info
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util[h])
    return mod


def test_monitor_numbers_from_fake_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = GpuMonitor().sample()
    assert s["gpu/mem_used_gb"] == 6.0 and s["gpu/mem_used_gb_mean"] == pytest.approx(3.0)
    assert s["gpu/util_pct"] == 90.0 and s["gpu/util_pct_mean"] == pytest.approx(50.0)
    assert s["gpu/mem_total_gb"] == 80.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    s = GpuMonitor().sample()
    assert s["gpu/mem_used_gb"] == 2.0 and s["gpu/util_pct"] == 50.0


def test_monitor_swallows_nvml_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert GpuMonitor().sample() == {}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_query=True))
    m = GpuMonitor()
    assert m.enabled and m.sample() == {}


def test_fp8_default_is_bf16_and_fields_exist_in_megatron():
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert FP8Options().transformer_config_kwargs() == {"bf16": True, "params_dtype": torch.bfloat16}
    kw = FP8Options.from_mapping({"fp8": "hybrid", "recipe": "blockwise", "fp8_param": True}).transformer_config_kwargs(
        is_moe=True, token_dispatcher="alltoall"
    )
    assert set(kw) <= names, set(kw) - names
    assert kw["fp8"] == "hybrid" and kw["fp8_recipe"] == "blockwise" and kw["fp8_param"] is True
    assert kw["moe_router_padding_for_quantization"] is True
    kw2 = FP8Options(fp8="e4m3").transformer_config_kwargs(is_moe=True, token_dispatcher="allgather")
    assert "moe_router_padding_for_quantization" not in kw2


def test_fp8_kwargs_build_a_dense_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = FP8Options(fp8="e4m3", recipe="tensorwise", amax_history_len=16, margin=1).transformer_config_kwargs()
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kw)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_amax_history_len, cfg.fp8_margin) == ("e4m3", "tensorwise", 16, 1)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "section, field",
    [
        ({"fp8": "e5m2"}, "model.fp8.fp8"),
        ({"fp8": "e4m3", "recipe": "nvfp4"}, "model.fp8.recipe"),
        ({"amax_compute_algo": "mean"}, "model.fp8.amax_compute_algo"),
        ({"amax_history_len": 0}, "model.fp8.amax_history_len"),
        ({"margin": -1}, "model.fp8.margin"),
        ({"fp8_param": True}, "model.fp8.fp8_param"),
        ({"fp8": "e4m3", "first_last_layers_bf16": True}, "model.fp8.first_last_layers_bf16"),
        ({"amax_histroy_len": 4}, "model.fp8.amax_histroy_len"),
    ],
)
def test_fp8_errors_name_the_field(section, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        FP8Options.from_mapping(section, prefix="model.fp8")


def test_fp8_runtime_check_on_cpu():
    check_fp8_runtime(FP8Options())  # bf16: nothing to check
    with pytest.raises(RuntimeError, match="fp8='e4m3'.*CUDA"):
        check_fp8_runtime(FP8Options(fp8="e4m3"))
