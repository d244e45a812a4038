"""Loading a dist checkpoint reads each gated fc1's two halves into the parameter itself
(gspo_megatron/checkpoint/in_place_reads.py: Megatron's swiglu merge would torch.cat them into a new
tensor and copy it back) and still restores every weight exactly; halves that are not the
parameter's memory go through Megatron's merge."""

from __future__ import annotations

from checkpoint_workers import in_place_merge_job
from distributed_harness import run_ranks


def test_fc1_halves_load_in_place_and_weights_come_back(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path / "hf"), seed=4, num_hidden_layers=2)
    (r,) = run_ranks(in_place_merge_job, 1, str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    # every gated MLP: the routed experts of both layers (qwen3_moe tiny: no dense layer)
    assert r["changed"] == r["fc1"] > 0, r
    assert r["in_place"] == [True] * r["fc1"], r["in_place"]  # every fc1 was loaded in place
    assert r["fallback_ok"]
    assert r["equal"]
