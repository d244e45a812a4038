"""Engines that never drain (issue 35): the synchronous loop, whole-batch overlap and in-flight weight
updates on a long-tailed response-length task, measured on CPU side by side, plus a time model of the
same schemes at GPU scale.

Measured: five ``gspo-train`` runs (subprocesses, as shipped, one after the other) of the CPU demo model
with one disaggregated CPU-server engine (``rollout.engine=sglang rollout.engine_server=cpu
rollout.sync_mode=disaggregated``), the same seed, steps and batch, differing only in the loop:

(a) ``sync``: ``rollout.max_staleness=0``, the engine generates the whole batch, then the trainer trains;
(b) ``overlap``: ``rollout.max_staleness=1``, the next batch generates (whole) while the trainer trains;
(c) ``in_place`` / (d) ``retract`` / (e) ``abort``: ``rollout.inflight_updates`` in that sglang pause mode,
    ``rollout.max_staleness`` = ``--inflight-staleness`` (2: a group finishing after the step that
    followed its start is trained two versions on, ``orchestration/inflight.py``), ``rollout.inflight_groups``
    = ``--inflight-groups`` (default 0: the producer's default, twice the step's prompts; the producer
    counts groups generating *and* finished but not yet taken, so with exactly a step's prompts no slot
    draws again before the step takes its groups and the engine drains every step). (e) is slime's
    partial rollout as a pause mode: each sync aborts the running requests and their partial outputs
    are resubmitted at once (``engines/partial.py``).

The long tail. The tiny random-init policy samples nearly uniformly over its 320-id vocabulary (entropy
~5.75 nats = ln 320) and cannot be told how long to answer, and ``max_new_tokens`` is one number for all
prompts. What is clean: extra stop tokens (``rollout.stop``, single tokens): with ``k`` stop characters
besides the EOS, every token ends the response with probability ~(k + 1) / 320, so lengths are
geometric, mean ~320 / (k + 1) (7 characters: ~40 tokens), median ~0.69 x the mean, p99 ~4.6 x the mean
(6.6 x the median), cut at ``--new-tokens``. An exponential tail, not a log-normal one: the longest of a
step's 32 samples is ~5-6 x the median, of 1000 ~10 x; which samples are long is chance, not the prompt.
The reward (``first_char`` below) scores only the response's first character, so it does not pay for
length and learning does not move the length distribution by design (the policy still can: a stop
character's probability is the policy's).

Per arm, over the steps after ``--warmup`` (the first steps fill the pipeline):

- steps/hour: steps / their wall time (``time/elapsed`` of the last minus of the warmup step);
- engine idle: in-flight arms, 1 - mean ``rollout/engine_busy_frac`` (slot-seconds with a group
  generating / slot-seconds, slots = ``inflight_groups``: a group with one sample still decoding counts
  as busy, so this is group occupancy, not the share of sample slots decoding); sync / overlap arms
  report no slot occupancy, so their column is 1 - ``perf/rollout_s`` / step time, the share with *no*
  request in the engine: a lower bound (a draining batch's tail, one long sample running while the
  others are done, counts as busy);
- trainer idle: sum of what the trainer waited for samples / sum of step time (synchronous: the whole
  rollout, ``perf/rollout_s``; otherwise ``rollout/trainer_wait_s`` + ``rollout/sync_wait_s``);
- staleness (``rollout/staleness_mean`` / ``_max``), version span (``rollout/version_span_mean`` / ``_max``:
  a sample's newest minus oldest token version), ``rollout/stale_token_frac``, response length, truncated share;
- reward per step (``reward/mean``), the learning curve; the runs share seeds, not samples (which groups
  finish first, and the CPU engine's sampling, vary run to run).

On CPU the trainer and the engine share the same 2 cores, and the CPU server decodes each request with
its own forward (docs/cpu_server.md): its cost is per token, so a draining batch wastes no capacity and
the idle time in-flight updates remove on GPUs does not exist here. The measured columns show the
mechanisms (samples spanning versions, staleness, dropped stale groups, the pause's cost), not GPU-scale
speed; the time model covers the latter:

Time model (``--model-only``: no training). C = engines x slots decode slots, each decoding at
``engine_tok_s / slots`` tokens/s (decoding at scale is memory-bound: an engine's step time barely depends
on how many of its slots are full, so a slot's rate is taken constant and an emptied slot is idle
capacity). Response lengths log-normal (median ``--m-median``, p99 ``--m-p99``), cut at ``--m-max-tokens``; B
samples per step; W = sum of their lengths / slot rate (slot-seconds of decoding); G = the batch's
makespan on C slots (continuous batching, samples in arrival order, averaged over simulated steps); the
trainer's step T = B x (prompt + mean length) / ``train_tok_s``; a weight sync ``sync_s``; re-prefill R =
a slot's mean context in progress (prompt + E[L^2] / 2E[L], the age of a length-biased sample) x slots /
``prefill_tok_s`` per engine. Samples come in groups of ``group``; a group is trained once its longest
sample is done, and a new group is drawn only then (``orchestration/inflight.py``), so K groups in flight
(``inflight_groups``, generating or done and not yet taken; 0: twice a step's, the producer's default)
keep on average K x group x mean length / mean group-longest samples decoding: A = min(C, that) busy
slots (more groups queue in the engine). Every model input is a flag ``--m-<name>`` (``Scale``).
Steady-state step times:

- sync: G + T + sync_s (trainer idle: G; engines idle outside W);
- overlap (max_staleness=1): max(G, T) + sync_s;
- partial rollout (slime ``--partial-rollout``, synchronous loop): the rollout stops once B samples are
  done and the unfinished ones continue next rollout (re-prefilled): W / A + R + T + sync_s;
- in-flight, in place (PipelineRL): max(T, W / A) + sync_s;
- in-flight, retract / abort: max(T, W / A + R) + sync_s (each sync re-prefills what is in flight).

Engine idle share = 1 - W / (C x step) (re-prefill counted as idle: it is not decoding); trainer idle share
= the step minus the trainer's own T + sync_s, over the step. In-flight groups live through syncs: a
group whose longest sample has L tokens spans ~L / (slot rate x the step's decoding seconds) versions
(on average K / (B / group) by Little's law), so ``rollout.max_staleness`` must cover the longest
group's, or the long tail is dropped (``rollout/stale_groups_dropped``: training biased towards short
answers, and their decoding wasted); the last column is that share at ``max_staleness``, approximate
(a group's age counted as the syncs it lived through). The model assumes N large enough (no decode
lost to drops), a constant slot rate, no prefill cost for new prompts and no length bias in which
groups finish first.

    python bench/inflight.py [--steps 10 --warmup 2 --prompts 8 --group 4 --new-tokens 128]  # ~7 min
    python bench/inflight.py --quick      # 4 steps, 4 prompts, ~2.5 min
    python bench/inflight.py --model-only # the GPU-scale time model alone

Measured results and what they do and do not show: docs/bench.md, "In-flight weight updates (issue 35)".
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass, fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
STOP = "qxzjkvw"  # the extra stop characters (each one byte-level token of the demo tokenizer)
WIDTH = 64
ARMS = ("sync", "overlap", "in_place", "retract", "abort")


def first_char(prompt: str, response: str, label: object) -> float:
    """The task's reward (``reward.function=bench/inflight.py:first_char``, prompts of ``last_digit``):
    ``max(0, 1 - |ord(response[0]) - ord(label)| / 64)``, 0 for an empty response. Only the first
    character counts: nothing pays for length."""
    if not response:
        return 0.0
    return max(0.0, 1.0 - abs(ord(response[0]) - ord(str(label)[0])) / WIDTH)


# ---------------------------------------------------------------------------------------------------
# The time model at GPU scale (module docstring). Default assumptions, stated:
# - engine_tok_s 2150: SGLang serving Qwen3-30B-A3B on one H100, output tokens/s at its concurrency
#   plateau (Neural Nova, "Getting More Out of SGLang", 2025: 1,627 tok/s default, 2,151 tuned); an RL
#   engine at a large fixed batch may do better, so the absolute times are rough, the shares less so.
# - slots 64 per engine, 8 engines: 512 slots, one per sample of a 64 prompts x 8 batch; in flight:
#   twice a step's groups (the producer's default), max_staleness 2 (tests/train/test_inflight_run.py's).
# - lengths: median 4k, p99 32k, cut at 32k (long-CoT RL, e.g. DAPO / DeepSeek-R1-style runs at 32k).
# - train_tok_s 30000: the trainer's whole step (old log-probs, forward, backward, optimizer) on its own
#   GPUs; ~2.9M tokens per step -> ~100 s. prefill_tok_s 20000 per engine; sync_s 10 (60 GB of bf16).


@dataclass(frozen=True)
class Scale:
    median: float = 4096.0
    p99: float = 32768.0
    max_tokens: int = 32768
    prompt_tokens: int = 512
    batch: int = 512
    engines: int = 8
    slots: int = 64
    engine_tok_s: float = 2150.0
    prefill_tok_s: float = 20000.0
    train_tok_s: float = 30000.0
    sync_s: float = 10.0
    group: int = 8
    inflight_groups: int = 0
    max_staleness: int = 2
    sim_steps: int = 64
    seed: int = 0


SCHEMES = ("sync", "overlap N=1", "partial rollout", "in-flight in_place", "in-flight retract/abort")


def _lengths(s: Scale, n: int, rng: random.Random) -> list[float]:
    sigma = math.log(s.p99 / s.median) / 2.3263478740408408  # z of the 99th percentile
    mu = math.log(s.median)
    return [min(float(s.max_tokens), max(1.0, rng.lognormvariate(mu, sigma))) for _ in range(n)]


def _makespan(lengths: list[float], slots: int) -> float:
    """Tokens until the last of ``lengths`` is done on ``slots`` slots admitting them in order."""
    free = [0.0] * min(slots, len(lengths))
    for n in lengths:
        heapq.heapreplace(free, free[0] + n)
    return max(free)


def time_model(s: Scale) -> dict[str, dict[str, float]]:
    """Per scheme (``SCHEMES``): ``step_s``, ``engine_idle`` and ``trainer_idle`` (shares of the step),
    ``reprefill`` (share of the step the engines re-prefill), ``span_mean`` / ``span_max`` (weight syncs a
    group's generation lives through: mean, the longest group's), ``over_n`` (share of groups living
    through more than ``max_staleness`` syncs: dropped, or needing a larger N); ``"_"``: the model's
    intermediate quantities."""
    rng = random.Random(s.seed)
    C = s.engines * s.slots
    rate = s.engine_tok_s / s.slots  # tokens/s of one slot
    steps = [_lengths(s, s.batch, rng) for _ in range(s.sim_steps)]
    flat = [x for step in steps for x in step]
    groups = [max(step[i : i + s.group]) for step in steps for i in range(0, len(step), s.group)]
    mean_len = sum(flat) / len(flat)
    mean_group = sum(groups) / len(groups)  # a group's tokens until its longest sample is done
    age = sum(x * x for x in flat) / (2.0 * sum(flat))  # mean tokens already generated by a running sample
    W = s.batch * mean_len / rate  # slot-seconds of decoding per step
    G = sum(_makespan(step, C) for step in steps) / len(steps) / rate
    T = s.batch * (s.prompt_tokens + mean_len) / s.train_tok_s
    # groups in flight (``rollout.inflight_groups``, 0: twice a step's): a group holds its prompt until its
    # longest sample is done, its finished samples' slots free for other groups' samples; on average
    # group x mean / longest of its samples are still decoding
    k = s.inflight_groups or 2 * max(1, s.batch // s.group)
    active = min(float(C), k * s.group * mean_len / mean_group)
    R = (active / s.engines) * (s.prompt_tokens + age) / s.prefill_tok_s  # one re-prefill per engine
    gen = {  # (engine-side seconds per step, whether the engines wait while the trainer trains)
        "sync": (G, True),
        "overlap N=1": (G, False),
        "partial rollout": (W / active + R, True),
        "in-flight in_place": (W / active, False),
        "in-flight retract/abort": (W / active + R, False),
    }
    out = {}
    for name in SCHEMES:
        g, serial = gen[name]
        step = (g + T if serial else max(g, T)) + s.sync_s
        carried = name.startswith("in-flight") or name == "partial rollout"
        # decoding seconds per weight version of a running sample: a rollout's (partial rollout), the
        # step less the engines' pauses (in-flight)
        per_version = {"partial rollout": W / active, "in-flight in_place": step - s.sync_s}.get(
            name, step - s.sync_s - R
        )
        lives = [x / rate / per_version for x in groups] if carried else [0.0]
        out[name] = {
            "step_s": step,
            "engine_idle": min(1.0, max(0.0, 1.0 - W / (C * step))),
            "trainer_idle": min(1.0, max(0.0, (step - T - s.sync_s) / step)),
            "reprefill": (R / step) if name in ("partial rollout", "in-flight retract/abort") else 0.0,
            "span_mean": sum(lives) / len(lives),
            "span_max": s.max_tokens / rate / per_version if carried else 0.0,
            "over_n": sum(x > s.max_staleness for x in lives) / len(lives) if carried else 0.0,
        }
    out["_"] = {
        "mean_len": mean_len,
        "mean_group": mean_group,
        "G": G,
        "W_per_slot": W / C,
        "T": T,
        "R": R,
        "rate": rate,
        "C": C,
        "active": active,
        "inflight_groups": k,
    }
    return out


def print_model(s: Scale) -> dict:
    m = time_model(s)
    x = m["_"]
    print(
        f"\ntime model: {s.engines} engines x {s.slots} slots at {s.engine_tok_s:.0f} tok/s per engine "
        f"({x['rate']:.1f} tok/s per slot); lengths log-normal median {s.median:.0f}, p99 {s.p99:.0f}, cut at "
        f"{s.max_tokens} (mean {x['mean_len']:.0f}, longest of a group of {s.group}: {x['mean_group']:.0f}); "
        f"{s.batch} samples/step; trainer {s.train_tok_s:.0f} tok/s (T = {x['T']:.0f} s), sync {s.sync_s:.0f} s; "
        f"batch makespan G = {x['G']:.0f} s vs W/C = {x['W_per_slot']:.0f} s; {x['inflight_groups']} groups in "
        f"flight keep {x['active']:.0f} of {x['C']} slots decoding; re-prefill R = {x['R']:.0f} s per sync"
    )
    print(
        "| scheme | step time (s) | steps/hour | vs sync | engine idle | trainer idle | re-prefill "
        f"| syncs during a group (mean / longest) | groups over max_staleness={s.max_staleness} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = m["sync"]["step_s"]
    for name in SCHEMES:
        r = m[name]
        print(
            f"| {name} | {r['step_s']:.0f} | {3600 / r['step_s']:.1f} | {base / r['step_s']:.2f}x | "
            f"{100 * r['engine_idle']:.0f}% | {100 * r['trainer_idle']:.0f}% | {100 * r['reprefill']:.0f}% | "
            f"{r['span_mean']:.2f} / {r['span_max']:.1f} | {100 * r['over_n']:.0f}% |"
        )
    return m


# ---------------------------------------------------------------------------------------------------
# The measured runs.


def arm_overrides(arm: str, a) -> list[str]:
    common = [
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.sync_mode=disaggregated",
        "rollout.num_engines=1",
        "rollout.dynamic_sampling=false",
        f"rollout.prompts_per_step={a.prompts}",
        f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.new_tokens}",
        f"rollout.stop=[{', '.join(STOP[: a.stop_chars])}]",
        f"model.max_seq_len={a.new_tokens + 64}",
        "gspo.mini_batches=2",
        f"parallel.micro_batch_size={max(1, a.prompts * a.group // 2)}",
        f"train.steps={a.steps}",
        f"seed={a.seed}",
        "data.task=last_digit",
        f"reward.function={THIS}:first_char",
    ]
    if arm == "sync":
        return [*common, "rollout.max_staleness=0"]
    if arm == "overlap":
        return [*common, "rollout.max_staleness=1"]
    return [
        *common,
        f"rollout.max_staleness={a.inflight_staleness}",
        f"rollout.inflight_updates={arm}",
        f"rollout.inflight_groups={a.inflight_groups}",
    ]


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict], warmup: int) -> dict:
    before = [r for r in rows if r["step"] <= warmup]
    rows = [r for r in rows if r["step"] > warmup]
    t0 = before[-1]["time/elapsed"] if before else rows[0]["time/elapsed"] - rows[0]["perf/step_time_s"]
    wall = rows[-1]["time/elapsed"] - t0
    step_s = sum(r["perf/step_time_s"] for r in rows)
    if "rollout/trainer_wait_s" in rows[0]:
        wait = sum(r["rollout/trainer_wait_s"] + r.get("rollout/sync_wait_s", 0.0) for r in rows)
    else:
        wait = sum(r["perf/rollout_s"] for r in rows)
    if "rollout/engine_busy_frac" in rows[0]:
        idle, idle_kind = 1.0 - _mean(r["rollout/engine_busy_frac"] for r in rows), "slots"
    else:
        idle, idle_kind = max(0.0, 1.0 - sum(r["perf/rollout_s"] for r in rows) / step_s), "engine"

    def get(key, agg):
        vals = [r[key] for r in rows if key in r]
        return agg(vals) if vals else None

    return {
        "steps": len(rows),
        "steps_per_hour": 3600.0 * len(rows) / wall,
        "engine_idle": idle,
        "engine_idle_kind": idle_kind,
        "trainer_idle": wait / step_s,
        "staleness_mean": get("rollout/staleness_mean", _mean) or 0.0,
        "staleness_max": get("rollout/staleness_max", max) or 0.0,
        "span_mean": get("rollout/version_span_mean", _mean),
        "span_max": get("rollout/version_span_max", max),
        "stale_token_frac": get("rollout/stale_token_frac", _mean),
        "len_mean": get("rollout/response_len_mean", _mean),
        "truncated": get("rollout/truncated_frac", _mean),
        "dropped": get("rollout/stale_groups_dropped", sum),
        "rewards": [r["reward/mean"] for r in [*before, *rows]],
    }


def _f(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_measured(results: dict, a) -> None:
    base = results.get("sync")
    print(
        f"\nmeasured: steps {a.warmup + 1}..{a.steps}, {a.prompts} prompts x {a.group} samples, stop on "
        f"EOS or {a.stop_chars} characters, cut at {a.new_tokens} tokens; in-flight: max_staleness="
        f"{a.inflight_staleness}, {a.inflight_groups or 2 * a.prompts} groups in flight"
    )
    print(
        "| arm | steps/hour | vs sync | engine idle | trainer idle | staleness mean / max | version span mean / max "
        "| stale tokens | response len | truncated |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        ratio = f"{r['steps_per_hour'] / base['steps_per_hour']:.2f}x" if base else "-"
        idle = f"{100 * r['engine_idle']:.0f}%" + (
            " (no request; lower bound)" if r["engine_idle_kind"] == "engine" else ""
        )
        span = "n/a" if r["span_mean"] is None else f"{r['span_mean']:.2f} / {r['span_max']:.0f}"
        stale = "n/a" if r["stale_token_frac"] is None else f"{100 * r['stale_token_frac']:.0f}%"
        print(
            f"| {arm} | {r['steps_per_hour']:.0f} | {ratio} | {idle} | {100 * r['trainer_idle']:.0f}% | "
            f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {span} | {stale} | {_f(r['len_mean'], '.1f')} | "
            f"{_f(None if r['truncated'] is None else 100 * r['truncated'], '.1f')}% |"
        )
    n = max(len(r["rewards"]) for r in results.values())
    print("\nreward/mean per step (same seeds; step 1 first)")
    print("| arm | " + " | ".join(str(i + 1) for i in range(n)) + " |")
    print("|---|" + "---|" * n)
    for arm, r in results.items():
        print(f"| {arm} | " + " | ".join(f"{x:.3f}" for x in r["rewards"]) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the rates")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128, help="rollout.max_new_tokens (the cut)")
    p.add_argument("--stop-chars", type=int, default=7, help=f"extra stop characters, the first of {STOP!r}")
    p.add_argument("--inflight-staleness", type=int, default=2)
    p.add_argument("--inflight-groups", type=int, default=0, help="rollout.inflight_groups (0: 2 x --prompts)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--quick", action="store_true", help="4 steps, 1 warmup, 4 prompts")
    p.add_argument("--model-only", action="store_true", help="print the GPU-scale time model, run nothing")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    for f in fields(Scale):
        p.add_argument(f"--m-{f.name.replace('_', '-')}", type=type(f.default), default=f.default, dest=f"m_{f.name}")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.prompts = 4, 1, 4
    arms = [x for x in a.arms.split(",") if x]
    if any(x not in ARMS for x in arms):
        p.error(f"--arms: a comma-separated subset of {','.join(ARMS)}")
    if not 0 < a.stop_chars <= len(STOP):
        p.error(f"--stop-chars: 1..{len(STOP)}")
    scale = Scale(**{f.name: getattr(a, f"m_{f.name}") for f in fields(Scale)})
    if a.model_only:
        print_model(scale)
        return 0
    if a.warmup >= a.steps:
        p.error("--warmup must be below --steps")
    sys.path.insert(0, os.path.dirname(THIS))
    from run_utils import train

    root = a.out or tempfile.mkdtemp(prefix="gspo-inflight-bench-")
    os.makedirs(root, exist_ok=True)
    results = {}
    for arm in arms:
        rows, wall = train(os.path.join(root, arm), arm_overrides(arm, a))
        results[arm] = summarize(rows, a.warmup)
        print(f"{arm}: {len(rows)} steps in {wall:.0f} s (startup included)", flush=True)
    print_measured(results, a)
    print_model(scale)
    print(f"\nruns in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
