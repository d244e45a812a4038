"""Does the MTP draft keep up with the policy? Speculative rollouts with the published draft frozen, the
draft synced but not trained, and the draft trained online and synced, side by side.

Model: GLM-4.5's tiny config (``glm4_moe``: hidden 64, MoE, one MTP layer ``model.layers.<N>.*``, the
published layout), transformers' random init, the byte-level demo tokenizer (vocab 320), **sharpened**: the
output layer (``lm_head`` and the MTP layer's published copy ``shared_head.head``) multiplied by
``--head-scale``. Unsharpened, the random model samples nearly uniformly (entropy 5.75 nats = ln 320, the
largest probability 0.005), so no draft can predict it and every acceptance reads 0 (the first measured run
of this bench). Sharpened (x40), it is a stand-in for a pretrained policy: a fixed random "language" of
peaked cycles over a few bytes, predictable from its context (``policy/entropy`` about 1.3 nats at
temperature 1, against 5.75), that GSPO can still move.

Task: the ``last_digit`` prompts with ``bench/mtp_task.py``'s reward ``near_digit`` (the closeness of each of
the first 12 response characters to the number's last digit, by code point: dense from the first step, its
optimum far from the starting policy, so the policy has far to move). Engines: one disaggregated
CPU-server engine (``rollout.engine_server=cpu``: sglang's own target and draft classes load every sync;
``rollout.sync_mode=disaggregated``, ``rollout.num_engines=1``: the engine keeps its memory between rollouts)
decoding speculatively (``rollout.speculative=true``, ``speculative_steps`` draft tokens per verify, top-1
chains, sglang's acceptance rule; ``features/speculative.py``).

1. ``publish``: the "published" draft. GSPO on a constant reward (every advantage 0, so the policy's
   gradient is exactly 0 and Adam leaves it unchanged) with ``gspo.mtp_loss_coef=1`` and ``optimizer.lr`` =
   ``--publish-lr``: only the MTP layer learns, on the starting policy's own samples; its final export (the
   starting policy unchanged, the fitted MTP layer) is the checkpoint of the three runs.
2. From that checkpoint, the same seeds, ``--steps`` GSPO steps on the task at ``optimizer.lr`` = ``--lr``
   (default 1e-3, the demo's). The policy and the MTP layer share one optimizer, so ``--lr`` is also the
   draft's learning rate (``gspo.mtp_loss_coef`` scales the MTP gradient, which Adam normalizes away), and
   the sharpened head makes the policy move 40 times as far per update as the same weights unsharpened.
   Two regimes, both measured (docs/bench.md): at 1e-3 the policy collapses to one deterministic answer
   (entropy 0) within 2-5 steps, a different one in each run, and a trained draft learns it within about
   10 steps; at 2e-5 (``--lr 2e-5``) the policy moves steadily for 30 steps, but the draft, at that
   learning rate, does not move measurably and (c) reads as (a):
   (a) ``frozen``: ``model.mtp=false``: the MTP layer is carried, the engine keeps the published draft;
   (b) ``synced``: ``model.mtp=true``, ``gspo.mtp_loss_coef=0``: the draft is sent every step, unchanged
       (the same draft weights as (a): a check of the sync path, expected to read as (a));
   (c) ``trained``: ``model.mtp=true``, ``gspo.mtp_loss_coef`` = ``--coef``: trained online and synced.
   The runs share seeds, not rollouts: the CPU engine's sampling is not reproducible from run to run
   (step 1's rewards already differ by a few hundredths), so each run's policy follows its own path, and
   at 1e-3 the three end in different answers; compare each run's draft with its own policy (the trainer's
   acceptance) as much as the runs with each other.
   The draft runs on the current target's hidden states and shares its current embedding and head (sglang's
   ``set_embed_and_head``), so a frozen MTP layer is still fed a moving policy: what goes stale is the layer's
   own mapping.

Per run and step window: the reward, the engine's acceptance (``spec/engine_accept_rate``: accepted /
proposed draft tokens; ``spec/engine_accept_length``: tokens per verify forward, the bonus token
included, as sglang's ``spec_accept_length``) and the trainer's exact first-token acceptance on the
same rollouts (``spec/draft_accept_rate``: the share of response positions whose emitted token is the
draft's top-1, runs with the MTP layer in the model), the policy's entropy (``policy/entropy``), and the
ratio of each run's engine acceptance to the frozen run's in the same window.

Speed-up model (stated, not measured: decoding at scale is memory-bound, one verify of k + 1 tokens costs
about one decode forward of the target): per verify cycle the engine emits L = 1 + a k tokens (a: the
measured ``spec/engine_accept_rate``, accepted / proposed draft tokens; sglang's own
``spec_accept_length`` also counts the prefill's token, which no verify made) for one target forward plus k
draft forwards of relative cost r each, so tokens per unit of target-forward time = L / (1 + k r), against
1 without speculation. r = (one MTP layer) / (the target's layers), the MTP layer being one decoder layer
of the target's shape (the shared LM head is left out): ``--draft-cost`` (default 1/61, DeepSeek-V3's 61
layers; GLM-4.5: 1/92). The L above is exact for a chain that stops at its first rejection only when
acceptances are counted per verify, as here (accepted / proposed over whole verifies).

Why disaggregated, not colocated: a colocated engine releases its weights after every rollout
(``orchestration/colocation.py``, ``--enable-memory-saver``: the contents are lost, the draft's MTP layer
included, as in sglang without a CPU backup) and each sync refills only what it sends; with
``model.mtp=false`` no sync sends the MTP layer, so from the second step on the engine drafted with whatever
the resumed storage held: engine acceptance exactly 0 in (a) even with the policy unchanged (lr 1e-9), while
(b) kept about 0.25. The trainer now refuses ``rollout.speculative`` with ``model.mtp=false`` on colocated
engines (``features/speculative.py``); a disaggregated engine keeps the published draft (0.20, 0.27, 0.26
over the same three steps).

``--mtp-lr``: the trained run's ``optimizer.mtp_lr`` (the MTP layer's own param group): the draft learns
at its own rate while the policy moves at ``--lr``.

Not a test (about 25 minutes of 2 shared CPU cores): ``python bench/mtp_draft.py``.
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
    "rollout.sync_mode=disaggregated",  # not colocated: the module docstring
    "rollout.num_engines=1",
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
ARMS = ("frozen", "synced", "trained")


def write_checkpoint(out_dir: str, seed: int, head_scale: float) -> str:
    """GLM-4.5's tiny random model with its MTP layer (``models.tiny.save_tiny_hf_model(with_mtp=True)``),
    its output layer (``lm_head.weight`` and the MTP layer's copy ``shared_head.head.weight``) multiplied by
    ``head_scale``, + the demo tokenizer in ``out_dir``."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("glm4_moe", out_dir, seed=seed, vocab_size=320, with_mtp=True)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    heads = [k for k in tensors if k == "lm_head.weight" or k.endswith(".shared_head.head.weight")]
    assert len(heads) == 2, heads
    for k in heads:
        tensors[k] = (tensors[k] * head_scale).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
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


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="GSPO steps of each run on the task")
    ap.add_argument("--publish-steps", type=int, default=20, help="steps fitting the published draft")
    ap.add_argument("--window", type=int, default=5, help="steps per table row")
    ap.add_argument("--lr", type=float, default=1e-3, help="optimizer.lr of the three runs")
    ap.add_argument("--publish-lr", type=float, default=2e-2, help="optimizer.lr fitting the published draft")
    ap.add_argument("--head-scale", type=float, default=40.0, help="the random output layer's multiplier")
    ap.add_argument("--coef", type=float, default=1.0, help="gspo.mtp_loss_coef of the trained run")
    ap.add_argument("--mtp-lr", type=float, default=None, help="optimizer.mtp_lr of the trained run (null: --lr)")
    ap.add_argument("--spec-steps", type=int, default=3, help="rollout.speculative_steps")
    ap.add_argument("--draft-cost", type=float, default=1 / 61, help="r: a draft forward / a target forward")
    ap.add_argument("--arms", default=",".join(ARMS), help="runs of phase 2, a comma-separated subset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: a comma-separated subset of {','.join(ARMS)}, got {args.arms!r}")
    root = args.out or tempfile.mkdtemp(prefix="mtp_draft_")
    os.makedirs(root, exist_ok=True)
    base = write_checkpoint(os.path.join(root, "tiny-glm4-moe"), args.seed, args.head_scale)
    engine = [*ENGINE, f"rollout.speculative_steps={args.spec_steps}"]

    constant = os.path.join(root, "constant_reward.py")
    with open(constant, "w") as f:
        f.write("def one(prompt, response, label):\n    return 1.0\n")
    publish = os.path.join(root, "publish")
    pub_rows, wall = train(
        publish,
        [
            *engine,
            f"model.hf_path={base}",
            f"train.steps={args.publish_steps}",
            "model.mtp=true",
            "gspo.mtp_loss_coef=1.0",
            f"optimizer.lr={args.publish_lr}",
            f"reward.function={constant}:one",
        ],
    )
    published = os.path.join(publish, "hf_final")  # train.finish's export, the MTP layer included
    print(f"published draft: {args.publish_steps} steps in {wall:.0f} s -> {published}", flush=True)
    w = args.window
    print("\n| publish steps | engine accept rate | trainer accept rate | policy entropy |")
    print("|---|---|---|---|")
    for lo in range(0, len(pub_rows), w):
        hi = lo + w
        print(
            f"| {lo + 1}-{min(hi, len(pub_rows))} | {_fmt(window(pub_rows, 'spec/engine_accept_rate', lo, hi))} | "
            f"{_fmt(window(pub_rows, 'spec/draft_accept_rate', lo, hi))} | "
            f"{_fmt(window(pub_rows, 'policy/entropy', lo, hi), '.2f')} |",
            flush=True,
        )

    extra = {
        "frozen": ["model.mtp=false"],
        "synced": ["model.mtp=true", "gspo.mtp_loss_coef=0"],
        "trained": ["model.mtp=true", f"gspo.mtp_loss_coef={args.coef}"]
        + ([f"optimizer.mtp_lr={args.mtp_lr}"] if args.mtp_lr is not None else []),
    }
    results = {}
    for name in arms:
        rows, wall = train(
            os.path.join(root, name),
            [
                *engine,
                f"model.hf_path={published}",
                f"train.steps={args.steps}",
                f"optimizer.lr={args.lr}",
                f"reward.function={TASK}:near_digit",
                *extra[name],
            ],
        )
        results[name] = dict(rows=rows, wall_s=wall)
        print(f"{name}: {len(rows)} steps in {wall:.0f} s", flush=True)

    base_arm = arms[0]
    print()
    print(
        "| steps | run | reward | policy entropy | engine accept rate | vs "
        f"{base_arm} | engine accept length | trainer accept rate | speed-up (model) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lo in range(0, args.steps, w):
        hi = lo + w
        base_rate = window(results[base_arm]["rows"], "spec/engine_accept_rate", lo, hi)
        for name, r in results.items():
            rows = r["rows"]
            rate = window(rows, "spec/engine_accept_rate", lo, hi)
            print(
                f"| {lo + 1}-{min(hi, len(rows))} | {name} | {_fmt(window(rows, 'reward/mean', lo, hi))} | "
                f"{_fmt(window(rows, 'policy/entropy', lo, hi), '.2f')} | {_fmt(rate)} | {_ratio(rate, base_rate)} | "
                f"{_fmt(window(rows, 'spec/engine_accept_length', lo, hi), '.2f')} | "
                f"{_fmt(window(rows, 'spec/draft_accept_rate', lo, hi))} | "
                f"{_fmt(speedup(rate, args.spec_steps, args.draft_cost), '.2f')}x |"
            )
    print()
    for name, r in results.items():
        rows = r["rows"]
        step_s = mean(x.get("perf/step_time_s", 0.0) for x in rows)
        print(f"{name}: {r['wall_s']:.0f} s wall, {step_s:.1f} s per step (mean perf/step_time_s)")
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump({"publish": pub_rows, **{k: v["rows"] for k, v in results.items()}}, f)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
