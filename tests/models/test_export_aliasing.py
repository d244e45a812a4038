"""The HF export reads a one-rank gated fc1's two halves as views of the parameter (no copy), while
the weight stream (weight sync, and every caller that may hold tensors across an optimizer step)
never hands out memory of a live parameter -- for those halves too, whose data pointer is not the
parameter's -- and streams exactly the HF checkpoint's tensors."""

from __future__ import annotations

from conversion_workers import export_aliasing
from distributed_harness import run_ranks


def test_stream_never_aliases_a_parameter_and_export_copies_no_gated_half(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path / "hf"), seed=3, num_hidden_layers=2)
    (r,) = run_ranks(export_aliasing, 1, str(tmp_path / "hf"))
    assert r["aliased"] == [], r["aliased"]
    assert r["gated"] > 0 and all(r["views"]), r["views"]
    assert r["equal"]
