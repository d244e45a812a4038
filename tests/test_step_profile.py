"""bench/step_profile.py on CPU: the whole script on the demo's tiny MoE (both steps, the ratio, the
profile's shares), and its bucketing of a hand-made trace."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import step_profile  # noqa: E402
from subprocess_utils import run_group  # noqa: E402


def test_bucketing_of_a_hand_made_trace():
    trace = [
        ("bench:attention/aten::mm", 1.0),
        ("bench:attention/flash_fwd_kernel", 0.5),
        ("bench:moe/bench:experts/sm90_gemm_bf16", 2.0),
        ("bench:mlp/aten::addmm", 0.5),
        ("bench:moe/aten::sort", 0.25),
        ("bench:moe/bench:router/aten::topk", 0.25),
        ("void at::native::topk_kernel", 0.5),  # no range: by name
        ("bench:loss/bench:logprob_head/aten::mm", 1.5),
        ("bench:output_layer_none/cross_entropy_fwd", 0.5),  # unknown range: by name
        ("bench:loss/aten::exp", 0.5),
        ("bench:packing/aten::copy_", 0.25),
        ("bench:optimizer/multi_tensor_apply_kernel", 0.75),
        ("ncclDevKernel_ReduceScatter_Sum_f32", 0.5),
        ("bench:attention/MmBackward0/torch::autograd::AccumulateGrad/aten::add_", 0.25),  # range wins
        ("torch::autograd::AccumulateGrad/aten::add_", 0.25),
        ("bench:grad_reduce/aten::div_", 0.5),
        ("aten::rms_norm", 1.0),
    ]
    res = step_profile.bucket_shares(trace, wall_s=12.0)
    s = res["seconds"]
    expected = {
        "attention": 1.75,
        "experts": 2.5,
        "router_dispatch": 1.0,
        "logprob_head": 2.0,
        "loss": 0.5,
        "packing": 0.25,
        "optimizer": 0.75,
        "grad_reduce": 1.25,
        "other": 1.0,
        "host_idle": 1.0,
    }
    assert set(s) == set(step_profile.BUCKETS) == set(expected)
    for k, v in expected.items():
        assert s[k] == pytest.approx(v), k
    assert res["busy_s"] == pytest.approx(11.0)
    assert sum(res["percent"].values()) == pytest.approx(100.0)
    assert res["percent"]["experts"] == pytest.approx(100 * 2.5 / 12)
    # no wall time (or a wall shorter than the busy time): no idle, the shares still add up to 100
    for wall in (None, 5.0):
        short = step_profile.bucket_shares(trace, wall_s=wall)
        assert short["seconds"]["host_idle"] == 0.0
        assert sum(short["percent"].values()) == pytest.approx(100.0)
    assert step_profile.bucket_shares([])["percent"]["other"] == 0.0


def _event(name, parent=None, seq=-1, thread=1, fwd_thread=None, start=0.0, kernels=(), cpu_us=0.0, note=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(
        name=name,
        cpu_parent=parent,
        scope=0,
        sequence_nr=seq,
        thread=thread,
        fwd_thread=fwd_thread,
        time_range=SimpleNamespace(start=start),
        kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels],
        device_type=DeviceType.CPU,
        is_user_annotation=note,
        self_cpu_time_total=cpu_us,
    )


def test_trace_events_name_kernels_and_backward_ops_by_their_forward_ranges():
    from types import SimpleNamespace

    attn = _event("bench:attention", note=True, kernels=[("bench:attention", 100.0)], cpu_us=5.0)
    mm = _event("aten::mm", attn, seq=7, start=1.0, kernels=[("sm90_gemm", 30.0)], cpu_us=3.0)
    node = _event("autograd::engine::evaluate_function: MmBackward0", seq=7, thread=2, fwd_thread=1, start=2.0)
    bw = _event("aten::mm", node, thread=2, start=3.0, kernels=[("sm90_gemm", 60.0)], cpu_us=4.0)
    comm = _event("c10d::allreduce_", start=4.0, kernels=[("ncclDevKernel_AllReduce", 10.0)], cpu_us=1.0)
    prof = SimpleNamespace(events=lambda: [attn, mm, node, bw, comm])
    cuda = step_profile.trace_events(prof, cuda=True)
    assert cuda == [
        ("bench:attention/aten::mm/sm90_gemm", pytest.approx(30e-6)),
        (f"bench:attention/{node.name}/aten::mm/sm90_gemm", pytest.approx(60e-6)),
        ("c10d::allreduce_/ncclDevKernel_AllReduce", pytest.approx(10e-6)),
    ]
    seconds = step_profile.bucket_shares(cuda, wall_s=200e-6)["seconds"]
    assert seconds["attention"] == pytest.approx(90e-6) and seconds["grad_reduce"] == pytest.approx(10e-6)
    assert seconds["host_idle"] == pytest.approx(100e-6)
    cpu = dict(step_profile.trace_events(prof, cuda=False))  # self CPU time; the range's own is host time
    assert cpu == {
        "bench:attention/aten::mm": pytest.approx(3e-6),
        f"bench:attention/{node.name}/aten::mm": pytest.approx(4e-6),
        "c10d::allreduce_": pytest.approx(1e-6),
    }


def test_all_tiny_on_cpu(tmp_path):
    out = tmp_path / "step_profile.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "bench", "step_profile.py"),
        "all",
        "--tiny",
        "--sequences",
        "6",
        "--prompt",
        "4",
        "--max-response",
        "64",
        "--micro-batch-size",
        "2",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_group(cmd, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == {"baseline", "profile"}
    layouts = set(res["baseline"])
    assert "padded" in layouts and layouts == set(res["profile"])
    for layout, b in res["baseline"].items():
        ratio = b["ratio_ours_over_megatron"]
        assert math.isfinite(ratio) and ratio > 0, layout
        assert b["ratio_ours_over_megatron"] == pytest.approx(b["ours_step_s"] / b["megatron_step_s"])
        tokens = b["tokens_through_model"]
        assert tokens["ours"] == tokens["megatron"] > 0, layout
        assert len(b["ours_steps_s"]) == len(b["megatron_steps_s"]) == 1
        assert f"[{layout}] ratio ours/megatron: " in proc.stdout
    for layout, p in res["profile"].items():
        assert set(p["percent"]) == set(step_profile.BUCKETS)
        assert sum(p["percent"].values()) == pytest.approx(100.0, abs=1e-6), layout
        assert all(v >= 0 for v in p["percent"].values())
        for k in ("attention", "experts", "router_dispatch", "logprob_head", "loss", "optimizer"):
            assert p["seconds"][k] > 0, (layout, k)
