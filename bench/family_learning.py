"""Does GSPO learn on each 2026 family? Reward curves of the five new families next to the demo's model.

Per family (qwen3_5_moe, qwen3_next, deepseek_v32, glm_moe_dsa, minimax_m2): the family's tiny random
checkpoint (``ModelFamily.tiny``: hidden 64, 4 layers, 8 experts, every feature of the published
config: Gated DeltaNet / full-attention layer mix, DSA indexer with index_topk 6 below the prompts'
18-20 tokens, sigmoid routers with bias, ...), written by transformers' ``save_pretrained`` with the
byte-level demo tokenizer (vocab 320), trained by ``gspo-train`` with the demo's settings
(configs/demo_cpu.yaml: the ``last_digit`` task, GSPO, lr 0.001, 16 prompts x 8 samples per step) and
a colocated CPU-server engine (sglang's model classes, ``rollout.engine_server=cpu``, fp32); the DSA
families with ``rollout.routing_replay=r3`` (the engine's indexer choices and routes replayed: without
it the indexer's CPU ties make engine and trainer disagree, tests/train/test_indexer_replay_run.py).
Baseline in the same invocation: ``demo``, the demo's own random-init tiny-qwen3-moe (2 layers, 4
experts) under the same settings.

Prints per run the mean reward of the first and last ``--window`` steps, the max over steps of
``rollout/logprob_abs_diff`` (engine vs trainer old-policy log-prob of the sampled tokens) and of
``sync/verify_max_abs_diff`` (the post-sync probe), and the wall time. Not a test (minutes of CPU):
``python bench/family_learning.py --steps 80``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from run_utils import ROOT, mean, train

sys.path.insert(0, ROOT)  # gspo_megatron from a checkout (write_checkpoint)

FAMILIES = ["qwen3_5_moe", "qwen3_next", "deepseek_v32", "glm_moe_dsa", "minimax_m2"]
DSA = ("deepseek_v32", "glm_moe_dsa")
ENGINE = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "rollout.engine_tp=1",
    "rollout.sync_verify=true",
    "rollout.sync_verify_every=1",
]


def write_checkpoint(family: str, out_dir: str, seed: int) -> str:
    """The family's tiny random model (transformers' save_pretrained) + the demo tokenizer in ``out_dir``."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model(family, out_dir, seed=seed, vocab_size=320)  # the tokenizer's 259 ids fit
    build_demo_tokenizer(out_dir)
    return out_dir


def summary(name: str, rows: list[dict], wall: float, w: int) -> dict:
    r = [x["reward/mean"] for x in rows]
    return dict(
        run=name,
        steps=len(rows),
        first=mean(r[:w]),
        last=mean(r[-w:]),
        gap_max=max(x["rollout/logprob_abs_diff"] for x in rows),
        probe_max=max((x["sync/verify_max_abs_diff"] for x in rows if "sync/verify_max_abs_diff" in x), default=None),
        wall_s=wall,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    ap.add_argument("--no-baseline", action="store_true", help="skip the demo-model run")
    ap.add_argument("--seed", type=int, default=0, help="the tiny checkpoints' init seed")
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="family_learning_")
    os.makedirs(root, exist_ok=True)
    steps = [f"train.steps={args.steps}"]
    runs = [] if args.no_baseline else [("demo", steps)]  # configs/demo_cpu.yaml's random-init tiny-qwen3-moe
    for fam in args.families:
        hf_dir = write_checkpoint(fam, os.path.join(root, f"tiny-{fam}"), args.seed)
        model = [f"model.hf_path={hf_dir}", "model.init=pretrained", "model.arch=null"]
        runs.append((fam, [*steps, *model, *(["rollout.routing_replay=r3"] if fam in DSA else [])]))
    w = args.window
    print(f"| run | steps | reward first-{w} | reward last-{w} | logprob_abs_diff max | sync probe max | wall (s) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    results = []
    for name, overrides in runs:
        rows, wall = train(os.path.join(root, name), [*ENGINE, *overrides])
        s = summary(name, rows, wall, w)
        results.append(s)
        probe = "-" if s["probe_max"] is None else f"{s['probe_max']:.1e}"
        print(
            f"| {name} | {s['steps']} | {s['first']:.3f} | {s['last']:.3f} | {s['gap_max']:.1e} | {probe} | "
            f"{s['wall_s']:.0f} |",
            flush=True,
        )
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
