"""Delta sync against full sync over a real GSPO run (``rollout.sync_delta``, weight_sync/delta.py).

Per sync mode, two gspo-train runs with the same seed under torchrun (2 ranks, CPU): colocated (two
CPU-server engines of engine_tp 1 on the training ranks' "GPUs") and disaggregated (one CPU-server engine
of engine_tp 1 started by rank 0 after its training ranks; the delta run sends through
weight_sync/delta_http.py: the changes in files named by HTTP); the delta runs start the engines
with the delta loader as sglang's ``--custom-weight-loader``; bf16 weights, an RL learning rate (default 1e-6), a Qwen3-MoE of tens of
millions of parameters (the tiny config with bigger dims, random init, the demo task). Both runs are
launched by tests/train/ordered_sync_check.py (tests/topology/sync_check.py with one generation
request at a time, so both runs see the same batch order), which after every sync compares every engine TP rank's
weights with the trainer's HF export bitwise.

Printed per step: bytes and seconds of the sync in each run (full: the bucket bytes the engine reads;
delta: the payload bytes of the encoded changes, and the bytes a full sync would have sent), the
fraction of elements that changed, and at the end the bitwise verdicts and whether the two runs'
learning metrics are equal.

Usage: python bench/sync_delta.py [--mode both|colocated|disaggregated] [--steps 6] [--lr 1e-6]
    [--hidden 512] [--layers 4] [--experts 8] [--moe-ffn 512] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC_CHECK = os.path.join(ROOT, "tests", "train", "ordered_sync_check.py")  # sync_check.py, requests in order
VARYING = ("sync/", "time/", "perf/", "timing/")
MODES = {
    "colocated": ["rollout.sync_mode=colocated"],
    "disaggregated": ["rollout.sync_mode=disaggregated", "rollout.num_engines=1"],
}


def make_model(path: str, a) -> int:
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(
        "qwen3_moe",
        path,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_experts=a.experts,
        moe_intermediate_size=a.moe_ffn,
        intermediate_size=2 * a.moe_ffn,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=a.hidden // 8,
        vocab_size=384,
    )  # >= the demo tokenizer's 259 tokens
    return sum(p.numel() for p in model.parameters())


def run(name: str, workdir: str, model_dir: str, a, extra: list[str]) -> tuple[list[dict], list[dict]]:
    from gspo_megatron.runtime.ports import free_port

    out, checks = os.path.join(workdir, name), os.path.join(workdir, f"{name}_checks.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        SYNC_CHECK,
        "--config",
        os.path.join(ROOT, "configs/demo_cpu.yaml"),
        f"output_dir={out}",
        f"model.hf_path={model_dir}",
        "model.init=random",
        "model.dtype=bfloat16",
        f"optimizer.lr={a.lr}",
        f"train.steps={a.steps}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=3",
        "parallel.micro_batch_size=4",
        "gspo.mini_batches=2",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.interval=0",
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.engine_tp=1",
        "rollout.engine_deterministic=true",
        "rollout.sync_verify_every=0",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GSPO_SYNC_CHECK_FILE=checks)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"{name} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(checks) as f:
        return rows, [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--workdir", default=None)
    p.add_argument("--mode", choices=("both", *MODES), default="both")
    a = p.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="sync_delta_")
    model_dir = os.path.join(workdir, "model")
    n = make_model(model_dir, a)
    print(
        f"model: Qwen3-MoE hidden {a.hidden}, {a.layers} layers, {a.experts} experts, moe_ffn {a.moe_ffn}: "
        f"{n / 1e6:.1f}M parameters ({2 * n / 1e6:.1f} MB in bf16); lr {a.lr}; {a.steps} steps; workdir {workdir}"
    )
    for mode in MODES if a.mode == "both" else (a.mode,):
        report(mode, workdir, model_dir, a)


def report(mode: str, workdir: str, model_dir: str, a) -> None:
    """One sync mode: the full run, the delta run, the table and verdicts."""
    full, full_checks = run(f"{mode}_full", workdir, model_dir, a, MODES[mode])
    delta, delta_checks = run(f"{mode}_delta", workdir, model_dir, a, [*MODES[mode], "rollout.sync_delta=true"])
    print(f"\n[{mode}]")
    print(
        f"{'step':>4} {'full MB':>9} {'full s':>8} {'delta MB':>9} {'delta s':>8} {'bytes %':>8} "
        f"{'changed %':>10} {'tensors sent full':>18}"
    )
    ratios = []
    for f_row, d_row in zip(full, delta):
        full_mb, delta_mb = f_row["sync/bytes"] / 1e6, d_row["sync/delta_wire_bytes"] / 1e6
        ratios.append(d_row["sync/delta_wire_bytes"] / d_row["sync/delta_full_bytes"])
        print(
            f"{f_row['step']:>4} {full_mb:>9.2f} {f_row['sync/total_s']:>8.3f} {delta_mb:>9.4f} "
            f"{d_row['sync/total_s']:>8.3f} {100 * ratios[-1]:>8.4f} {100 * d_row['sync/delta_fraction']:>10.4f} "
            f"{int(d_row['sync/delta_tensors_full']):>18}"
        )
    med = statistics.median
    print(
        f"\nmedian sync seconds: full {med(r['sync/total_s'] for r in full):.3f}, "
        f"delta {med(r['sync/total_s'] for r in delta):.3f}; median delta bytes / full bytes {100 * med(ratios):.4f}%"
    )
    for name, checks in (("full", full_checks), ("delta", delta_checks)):
        bad = [c for c in checks if c["mismatches"]]
        print(
            f"{name}: {len(checks)} syncs checked against the trainer's HF export, every engine TP rank bitwise: "
            f"{'all equal' if not bad else f'{len(bad)} with mismatches'}"
        )

    def learning(rows):
        return [
            {k: v for k, v in r.items() if not k.startswith(VARYING) and "_s" not in k.rsplit("/", 1)[-1]} for r in rows
        ]

    print(f"learning metrics of the two runs equal: {learning(full) == learning(delta)}")


if __name__ == "__main__":
    main()
