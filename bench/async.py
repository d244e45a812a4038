"""Steps per minute of the synchronous loop vs. off-policy overlap (``rollout.max_staleness`` 1 and 2),
same config, one invocation (issue 12).

Each mode is one ``gspo-train`` run (a subprocess, as shipped) of the CPU demo with a disaggregated
CPU-server engine (``rollout.engine=sglang rollout.engine_server=cpu rollout.sync_mode=disaggregated``),
identical but for ``rollout.max_staleness``; the modes run one after the other. Measured from each
run's metrics.jsonl over the steps after ``--warmup``:

- steps/min = steps / sum of their ``perf/step_time_s`` (a step: wait for / take the batch, old
  log-probs, the optimizer steps, the weight sync; with overlap the next batches are generated meanwhile);
- trainer wait share: the share of step time the trainer waited for samples. Synchronous: the whole
  rollout (``perf/rollout_s``); overlapped: ``rollout/trainer_wait_s`` + ``rollout/sync_wait_s`` (the
  sync waiting for the generation in flight, finish-first);
- engine idle share: 1 - generation time (``perf/rollout_s``: generation + rewards) / step time; with
  overlap the part of it spent waiting for newer weights is ``rollout/engine_wait_s``.

    python bench/async.py [--steps 10 --warmup 2 --prompts 16 --group 4 --new-tokens 4]

On CPU the trainer and the engine share the same cores (2 here, shared with other work), so the
overlap can only hide what one core's worth of engine or trainer leaves idle; on GPUs the engines have
their own devices. Ratios are printed against the synchronous run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def run(out: str, staleness: int, a) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        f"output_dir={out}",
        f"train.steps={a.steps}",
        f"rollout.prompts_per_step={a.prompts}",
        f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.new_tokens}",
        "gspo.mini_batches=2",
        f"parallel.micro_batch_size={a.prompts * a.group // 2}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.interval=0",
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.sync_mode=disaggregated",
        "rollout.num_engines=1",
        f"rollout.max_staleness={staleness}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run max_staleness={staleness} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def summarize(rows: list[dict], warmup: int) -> dict:
    rows = [r for r in rows if r["step"] > warmup]
    step = sum(r["perf/step_time_s"] for r in rows)
    gen = sum(r["perf/rollout_s"] for r in rows)
    if "rollout/trainer_wait_s" in rows[0]:
        trainer_wait = sum(r["rollout/trainer_wait_s"] + r["rollout/sync_wait_s"] for r in rows)
        engine_wait = sum(r["rollout/engine_wait_s"] for r in rows)
        staleness = max(r["rollout/staleness_max"] for r in rows)
    else:
        trainer_wait, engine_wait, staleness = gen, None, 0
    return {
        "steps": len(rows),
        "steps_per_min": 60.0 * len(rows) / step,
        "trainer_wait_share": trainer_wait / step,
        "engine_idle_share": max(0.0, 1.0 - gen / step),
        "engine_weight_wait_share": None if engine_wait is None else engine_wait / step,
        "staleness_max": staleness,
        "reward_mean": sum(r["reward/mean"] for r in rows) / len(rows),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--modes", default="0,1,2", help="max_staleness values to run, in order")
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="gspo-async-bench-") as tmp:
        for n in [int(x) for x in a.modes.split(",")]:
            results[n] = summarize(run(os.path.join(tmp, f"n{n}"), n, a), a.warmup)
            print(f"max_staleness={n}: {json.dumps(results[n])}", flush=True)
    base = results.get(0)
    print(f"\nsteps {a.warmup + 1}..{a.steps}, {a.prompts} prompts x {a.group} samples, {a.new_tokens} new tokens")
    print(
        "| mode | steps/min | vs sync | trainer waits | engines idle | (of which waiting for weights) | max staleness |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, r in results.items():
        ratio = f"{r['steps_per_min'] / base['steps_per_min']:.2f}x" if base else "-"
        ww = "-" if r["engine_weight_wait_share"] is None else f"{100 * r['engine_weight_wait_share']:.0f}%"
        name = "synchronous" if n == 0 else f"max_staleness={n}"
        print(
            f"| {name} | {r['steps_per_min']:.1f} | {ratio} | {100 * r['trainer_wait_share']:.0f}% | "
            f"{100 * r['engine_idle_share']:.0f}% | {ww} | {r['staleness_max']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
