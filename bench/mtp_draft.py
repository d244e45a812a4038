"""Does the MTP draft keep up with the policy? Speculative rollouts with the published draft frozen, the
draft synced but not trained, and the draft trained online and synced, side by side.

Model: GLM-4.5's tiny config (``glm4_moe``: hidden 64, MoE, one MTP layer ``model.layers.<N>.*``, the
published layout), transformers' random init, the byte-level demo tokenizer (vocab 320). Task: the
``last_digit`` prompts with the reward of ``bench/mtp_task.py`` (the share of the first 12 response
characters equal to the number's last digit: long responses, and a policy that moves far from its start).
Engines: one colocated CPU-server engine (``rollout.engine_server=cpu``: sglang's own target and draft
classes load every sync) decoding speculatively (``rollout.speculative=true``, ``speculative_steps``
draft tokens per verify, top-1 chains, sglang's acceptance rule; ``features/speculative.py``).

1. ``publish``: the "published" draft. GSPO on a constant reward (every advantage 0, so the policy's
   gradient is exactly 0 and Adam leaves it unchanged) with ``gspo.mtp_loss_coef=1``: only the MTP layer
   learns, on the starting policy's own samples; its final export is the checkpoint of the three runs.
2. From that checkpoint, the same seeds, ``--steps`` GSPO steps on the task:
   (a) ``frozen``: ``model.mtp=false``: the MTP layer is carried, the engine keeps the published draft;
   (b) ``synced``: ``model.mtp=true``, ``gspo.mtp_loss_coef=0``: the draft is sent every step, unchanged;
   (c) ``trained``: ``model.mtp=true``, ``gspo.mtp_loss_coef`` = ``--coef``: trained online and synced.

Per run and step window: the reward, the engine's acceptance (``spec/engine_accept_rate``: accepted /
proposed draft tokens; ``spec/engine_accept_length``: tokens per verify forward, the bonus token
included, as sglang's ``spec_accept_length``) and the trainer's exact first-token acceptance on the
same rollouts (``spec/draft_accept_rate``, runs with the MTP layer in the model).

Speed-up model (stated, not measured: decoding at scale is memory-bound, one verify of k + 1 tokens costs
about one decode forward of the target): per verify cycle the engine emits L = 1 + a k tokens (a: the
measured ``spec/engine_accept_rate``, accepted / proposed draft tokens; sglang's own
``spec_accept_length`` also counts the prefill's token, which no verify made, so it reads about 1.1
here even when nothing is accepted) for one target forward plus k draft forwards of relative cost r
each, so tokens per unit of target-forward time = L / (1 + k r), against 1 without speculation. r = (one MTP layer) / (the target's
layers), the MTP layer being one decoder layer of the target's shape (the shared LM head is left out):
``--draft-cost`` (default 1/61, DeepSeek-V3's 61 layers; GLM-4.5: 1/92). Not a test (minutes of CPU):
``python bench/mtp_draft.py --steps 40``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from run_utils import ROOT, mean, train

sys.path.insert(0, ROOT)  # gspo_megatron from a checkout

TASK = os.path.join(ROOT, "bench", "mtp_task.py")
ENGINE = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "rollout.engine_tp=1",
    "rollout.speculative=true",
    "rollout.max_new_tokens=12",
    "rollout.prompts_per_step=8",
    "parallel.micro_batch_size=32",
    "rollout.dynamic_sampling=false",
    "model.max_seq_len=64",
    "model.arch=null",
    "model.init=pretrained",
    "gspo.entropy_coef=0",
]


def write_checkpoint(out_dir: str, seed: int) -> str:
    """GLM-4.5's tiny random model with its MTP layer (``models.tiny.save_tiny_hf_model(mtp=...)``) + the
    demo tokenizer in ``out_dir``."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("glm4_moe", out_dir, seed=seed, vocab_size=320, with_mtp=True)
    build_demo_tokenizer(out_dir)
    return out_dir


def window(rows: list[dict], key: str, lo: int, hi: int) -> float | None:
    vals = [r[key] for r in rows[lo:hi] if key in r]
    return mean(vals) if vals else None


def speedup(accept_rate: float | None, steps: int, draft_cost: float) -> float | None:
    """Tokens per unit of target-forward time against plain decoding (module docstring)."""
    return None if accept_rate is None else (1.0 + accept_rate * steps) / (1.0 + steps * draft_cost)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--publish-steps", type=int, default=30, help="steps fitting the published draft")
    ap.add_argument("--window", type=int, default=10, help="steps per table row")
    ap.add_argument("--coef", type=float, default=1.0, help="gspo.mtp_loss_coef of the trained run")
    ap.add_argument("--spec-steps", type=int, default=3, help="rollout.speculative_steps")
    ap.add_argument("--draft-cost", type=float, default=1 / 61, help="r: a draft forward / a target forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="mtp_draft_")
    os.makedirs(root, exist_ok=True)
    base = write_checkpoint(os.path.join(root, "tiny-glm4-moe"), args.seed)
    engine = [*ENGINE, f"rollout.speculative_steps={args.spec_steps}", f"reward.function={TASK}:repeat_digit"]

    constant = os.path.join(root, "constant_reward.py")
    with open(constant, "w") as f:
        f.write("def one(prompt, response, label):\n    return 1.0\n")
    publish = os.path.join(root, "publish")
    _rows, wall = train(
        publish,
        [
            *engine,
            f"model.hf_path={base}",
            f"train.steps={args.publish_steps}",
            "model.mtp=true",
            "gspo.mtp_loss_coef=1.0",
            f"reward.function={constant}:one",
        ],
    )
    published = os.path.join(publish, "hf_final")  # train.finish's export, the MTP layer included
    print(f"published draft: {args.publish_steps} steps in {wall:.0f} s -> {published}", flush=True)

    runs = {
        "frozen": ["model.mtp=false"],
        "synced": ["model.mtp=true", "gspo.mtp_loss_coef=0"],
        "trained": ["model.mtp=true", f"gspo.mtp_loss_coef={args.coef}"],
    }
    results = {}
    for name, extra in runs.items():
        rows, wall = train(
            os.path.join(root, name), [*engine, f"model.hf_path={published}", f"train.steps={args.steps}", *extra]
        )
        results[name] = dict(rows=rows, wall_s=wall)
        print(f"{name}: {len(rows)} steps in {wall:.0f} s", flush=True)

    w = args.window
    print()
    print(
        "| steps | run | reward | engine accept rate | engine accept length | trainer accept rate | speed-up (model) |"
    )
    print("|---|---|---|---|---|---|---|")
    for lo in range(0, args.steps, w):
        for name, r in results.items():
            rows = r["rows"]
            length = window(rows, "spec/engine_accept_length", lo, lo + w)
            rate = window(rows, "spec/engine_accept_rate", lo, lo + w)
            print(
                f"| {lo + 1}-{min(lo + w, len(rows))} | {name} | {_fmt(window(rows, 'reward/mean', lo, lo + w))} | "
                f"{_fmt(rate)} | {_fmt(length, '.2f')} | "
                f"{_fmt(window(rows, 'spec/draft_accept_rate', lo, lo + w))} | "
                f"{_fmt(speedup(rate, args.spec_steps, args.draft_cost), '.2f')}x |"
            )
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({k: v["rows"] for k, v in results.items()}, f)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
