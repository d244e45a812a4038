"""Does GSPO with LoRA learn the demo task? Reward curves of LoRA runs, engine-trainer gap, sync bytes.

LoRA adapts a *pretrained* base: on the demo's random-init model the frozen output layer and final
norm cap the logits (RMS-normed hidden state times a 0.02-std output row: a logit range of about one
unit over 260 tokens), so no adapter on the transformer's linears can make the answer likely. So:

1. ``base``: the full-parameter demo (configs/demo_cpu.yaml) for ``--base-steps`` steps, exported
   to ``<out>/base/hf_final`` (the "pretrained" model: after 300 steps it has found the task, reward
   ~0.4-0.7; from a 120-step base, reward ~0.25, LoRA stays flat for 60 steps);
2. per placement, GSPO with ``model.lora`` (rank ``--rank``, alpha ``--alpha``, every attention /
   MLP / expert linear, ``rollout.lora_sync=merged``) from that base for ``--steps`` steps:
   ``inprocess`` (transformers engine in the trainer's process) and ``colocated`` (the CPU server,
   sglang's HTTP protocol, ``rollout.engine_server=cpu``, merged weights through the colocated sync);
   ``full``: the same continuation without LoRA (the demo's lr), for comparison.

Prints per run the mean reward of the first and last five steps (and of the first / last
``--window``), the mean / max ``rollout/logprob_abs_diff`` and the sync bytes per step
(``sync/bytes_total``: the merged model sent; ``sync/lora_adapter_bytes``: what an adapter-only sync
would send) with their ratio. Not a test (minutes of CPU):
``python bench/lora_learning.py --base-steps 300 --steps 150``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from run_utils import mean, train

PLACEMENTS = {
    "inprocess": [],
    "colocated": [
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.sync_mode=colocated",
        "rollout.engine_tp=1",
    ],
    "full": [],  # no LoRA: the full-parameter continuation
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument(
        "--lr",
        type=float,
        default=0.002,
        help="LoRA runs' optimizer.lr (the demo's full run: 0.001; 0.01 is too large: docs/training.md)",
    )
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--placements", nargs="+", default=["inprocess", "colocated", "full"], choices=sorted(PLACEMENTS))
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    ap.add_argument("--base", default=None, help="an HF base to start from (skips the base run)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lora_learning_")
    os.makedirs(root, exist_ok=True)
    base = args.base
    if base is None:
        train(os.path.join(root, "base"), [f"train.steps={args.base_steps}"])
        base = os.path.join(root, "base", "hf_final")
    results = {}
    for name in args.placements:
        lora = (
            []
            if name == "full"
            else [f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}", f"optimizer.lr={args.lr}"]
        )
        rows, _ = train(
            os.path.join(root, name),
            ["model.init=pretrained", f"model.hf_path={base}", f"train.steps={args.steps}", *lora, *PLACEMENTS[name]],
        )
        results[name] = rows
        r = [x["reward/mean"] for x in rows]
        gap = [x["rollout/logprob_abs_diff"] for x in rows]
        full, adapter = rows[-1]["sync/bytes_total"], rows[-1].get("sync/lora_adapter_bytes", 0.0)
        w = args.window
        print(
            f"{name:10s} reward first-5 {mean(r[:5]):.3f} last-5 {mean(r[-5:]):.3f} | first-{w} {mean(r[:w]):.3f} "
            f"last-{w} {mean(r[-w:]):.3f} | logprob_abs_diff mean {mean(gap):.2e} max {max(gap):.2e} | sync "
            f"{full / 1e6:.3f} MB/step merged"
            + (f", adapters {adapter / 1e6:.3f} MB ({full / adapter:.1f}x less)" if adapter else ""),
            flush=True,
        )
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({k: [x["reward/mean"] for x in v] for k, v in results.items()}, f)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
