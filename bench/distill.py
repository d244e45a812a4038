"""On-policy distillation (issue 36) on CPU: GSPO alone, distillation alone and the mix, side by side.

The teacher: the CPU demo's tiny model trained by supervised fine-tuning on the task's correct answers
(bench/distill_teacher.py, ~15 s; greedy accuracy 1.0 on held-out prompts), an HF directory with the
student's tokenizer. The student: the demo's fresh random init (configs/demo_cpu.yaml, its seed).
Three ``gspo-train`` runs (subprocesses, one after the other, bench/run_utils.py), the same seed,
batch and steps:

(a) ``gspo``: the demo as it is (no teacher; ``--gspo-teacher``: the teacher scores at ``distill.coef=0``,
    so ``distill/reverse_kl`` is measured while the loss stays GSPO's bitwise);
(b) ``distill``: distillation alone, ``distill.coef=1 distill.reward_coef=0`` (``--coef``: another coef):
    the loss is the per-token reverse-KL advantage ``log p_teacher(y_t) - log p_student(y_t)`` on the
    student's own samples, the reward only logged. ``rollout.dynamic_sampling=false`` in this arm (``--distill-dynamic-sampling``
    keeps the demo's true): dynamic sampling drops groups whose rewards are all equal, which would
    let the reward choose what the student distills on;
(c) ``mix``: ``distill.coef=1 distill.reward_coef=1`` (``--coef``), the demo's settings otherwise.

(b) and (c) start the teacher from its HF directory as a CPU server, as the trainer does for
``distill.teachers=['t=DIR']`` with ``rollout.engine_server=cpu`` (``distill/teacher_servers.py``); the
student's engine stays the demo's in-process transformers engine.

Printed: per arm the reward (``reward/mean``: the first sampling round on fresh prompts, temperature 1)
at a few steps, each the mean of the 3 steps ending there; the first step whose 3-step mean reaches 0.5
and 0.8; the run's wall seconds (start-up included) and the loop's seconds per step (``time/elapsed``);
``distill/reverse_kl`` (engine minus teacher log-prob, mean over sampled tokens) at the first and last
step; then the reward per step side by side. Before the runs, once: the teacher's log-probs from the
CPU-server engine against the teacher's transformers forward in fp32, on a few prompt + response
sequences (correct, wrong and random responses): the trainer's scoring request (``/generate`` with
``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` = the prompt's length - 1, read by the
trainer's ``distill.teachers.response_logprobs``) and one from the prompt's length; every log-prob
answered must be within 1e-5 (``check_teacher_logprobs``). Timings are printed, never checked.

    python bench/distill.py                      # 3 arms x 300 steps, ~10 min on 2 cores
    python bench/distill.py --arms gspo,mix --gspo-teacher --coef 0.1 --teacher DIR   # ~7 min
    python bench/distill.py --quick              # 3 steps per arm, ~1 min (tests/train/test_bench_distill.py)

Measured results: docs/bench.md, "On-policy distillation".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

THIS = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(THIS))

from distill_teacher import DEMO_CONFIG, read_report, sft_teacher  # noqa: E402
from run_utils import mean, train  # noqa: E402

ARMS = ("gspo", "distill", "mix")
CHECKPOINTS = (5, 10, 20, 40, 80, 150, 300)
THRESHOLDS = (0.5, 0.8)
WINDOW = 3  # steps averaged into a checkpoint's reward and into the thresholds' test
LOGPROB_TOL = 1e-5


def teacher_overrides(teacher: str) -> list[str]:
    """The trainer's keys that start ``teacher`` (an HF directory) as a CPU server named ``t``."""
    return [f"distill.teachers=['t={teacher}']", "rollout.engine_server=cpu"]


def arm_overrides(arm: str, teacher: str, a) -> list[str]:
    common = [f"train.steps={a.steps}", f"seed={a.seed}", f"data.task={a.task}", *a.override]
    if a.task != "last_digit":  # the demo's max_new_tokens (2) fits one digit and the end-of-turn token
        from gspo_megatron.data.tasks import get_task

        common.append(f"rollout.max_new_tokens={get_task(a.task).max_new_tokens}")
        common.append(f"reward.function={a.task}")
    if arm == "gspo":  # --gspo-teacher: the teacher scores (distill/reverse_kl), coef 0 keeps GSPO's loss bitwise
        return [*common, *teacher_overrides(teacher), "distill.coef=0"] if a.gspo_teacher else common
    loss = [f"distill.loss={a.loss}"] + ([f"distill.topk={a.topk}"] if a.loss.startswith("topk") else [])
    if arm == "distill":
        ds = [] if a.distill_dynamic_sampling else ["rollout.dynamic_sampling=false"]
        return [*common, *teacher_overrides(teacher), f"distill.coef={a.coef:g}", "distill.reward_coef=0", *ds, *loss]
    if arm == "mix":
        return [*common, *teacher_overrides(teacher), f"distill.coef={a.coef:g}", "distill.reward_coef=1", *loss]
    raise ValueError(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")


# ---------------------------------------------------------------------------------------------------
# The teacher's engine log-probs against its transformers forward.


def _check_sequences(teacher: str, task: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids + response ids, prompt length) of ``n`` student prompts (the trainer's dataset under
    the demo's config), each with the correct answer, a wrong digit and a few random byte tokens as the
    response (the first two ended by the end-of-turn token)."""
    from gspo_megatron import factory
    from gspo_megatron.config.loader import load_config

    cfg = load_config(DEMO_CONFIG, [f"seed={seed}", f"data.task={task}", "output_dir=/nonexistent"])
    tok = factory.build_tokenizer(teacher)
    rows = list(factory.build_dataset(cfg, tok))[:n]
    rng = random.Random(seed)
    eos = tok.eos_token_id
    out = []
    for r in rows:
        p = list(r.prompt_ids)
        right = tok.encode(str(r.label), add_special_tokens=False)
        wrong = tok.encode(str((int(str(r.label)[-1]) + 1 + rng.randrange(9)) % 10), add_special_tokens=False)
        noise = [rng.randrange(256) for _ in range(1 + rng.randrange(4))]
        for resp in (right + [eos], wrong + [eos], noise):
            out.append((p + resp, len(p)))
    return out


def _ask(client, seqs: list[tuple[list[int], int]], starts: list[int]) -> list[list]:
    """``/generate`` with ``max_new_tokens`` 0 and ``return_logprob`` over ``seqs`` (one batch), the i-th
    with ``logprob_start_len`` ``starts[i]``: each sequence's ``meta_info.input_token_logprobs``."""
    payload = {
        "input_ids": [ids for ids, _ in seqs],
        "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0} for _ in seqs],
        "return_logprob": True,
        "logprob_start_len": starts,
    }
    answers = client.post("generate", payload, timeout_s=300)
    answers = answers if isinstance(answers, list) else [answers]
    if len(answers) != len(seqs):
        raise RuntimeError(f"{len(answers)} answers for {len(seqs)} sequences")
    return [list((a.get("meta_info") or {}).get("input_token_logprobs") or []) for a in answers]


def check_teacher_logprobs(
    teacher: str, out_dir: str, *, task: str = "last_digit", n: int = 4, seed: int = 1234
) -> dict:
    """Start ``teacher`` as the trainer does (``distill.teacher_servers.StartedTeachers``, the CPU
    server in fp32), ask it for the input log-probs of a few prompt + response sequences and compare
    them with the teacher's transformers forward (fp32).

    Two requests. The trainer's scoring request (``distill/teachers.py``: ``logprob_start_len`` = the
    prompt's length P - 1, sglang answering ``None`` for entry 0 of every start), its answer read by the
    trainer's own ``response_logprobs``: one log-prob per response token. And ``logprob_start_len`` = P:
    entry j is input token P + j, its log-prob (when not None) given the tokens before it. Returns
    ``max_abs_diff`` (over every log-prob answered), ``sequences``, ``tokens`` (log-probs compared),
    ``ids_match`` (each answer's token ids are the sequence's), ``covered`` (the trainer's read gave
    every response token a log-prob), ``ok`` (all three and the difference below ``LOGPROB_TOL``),
    ``start_s`` (the server's start) and ``score_s`` (both requests)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from gspo_megatron.config.loader import load_config
    from gspo_megatron.distill.teacher_servers import StartedTeachers
    from gspo_megatron.distill.teachers import response_logprobs
    from gspo_megatron.features.distill import parse_teachers

    seqs = _check_sequences(teacher, task, n, seed)
    cfg = load_config(DEMO_CONFIG, [f"output_dir={out_dir}", "distill.coef=1", *teacher_overrides(teacher)])
    t0 = time.time()
    started = StartedTeachers(cfg, parse_teachers(cfg.distill.teachers)[0])
    try:
        start_s = time.time() - t0
        t1 = time.time()
        client = started.clients[0]
        trainers = _ask(client, seqs, [p - 1 for _, p in seqs])
        from_p = _ask(client, seqs, [p for _, p in seqs])
        score_s = time.time() - t1
    finally:
        started.close()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar for 25 tensors
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    worst, tokens, ids_match, covered = 0.0, 0, True, True
    with torch.no_grad():
        for (ids, p), mine, theirs in zip(seqs, from_p, trainers):
            ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            want = [float(ref[pos - 1, ids[pos]]) for pos in range(p, len(ids))]  # log p(token pos | before)
            rec = SimpleNamespace(prompt_ids=ids[:p], response_ids=ids[p:], response_len=len(ids) - p)
            try:
                got = response_logprobs({"meta_info": {"input_token_logprobs": theirs}}, rec, "the teacher")
            except Exception as e:  # noqa: BLE001 - the trainer's read refused the answer: reported, not raised
                print(f"the trainer's read of the teacher's answer failed: {e}", flush=True)
                covered = False
            else:
                worst = max([worst, *(abs(a - b) for a, b in zip(got, want))])
                tokens += len(got)
            if [int(e[1]) for e in mine] != ids[p:] or [int(e[1]) for e in theirs] != ids[p - 1 :]:
                ids_match = False
                continue
            for j, e in enumerate(mine):
                if e[0] is not None:
                    worst = max(worst, abs(float(e[0]) - want[j]))
                    tokens += 1
    return {
        "max_abs_diff": worst,
        "sequences": len(seqs),
        "tokens": tokens,
        "ids_match": ids_match,
        "covered": covered,
        "ok": ids_match and covered and tokens > 0 and worst < LOGPROB_TOL,
        "start_s": start_s,
        "score_s": score_s,
    }


# ---------------------------------------------------------------------------------------------------
# The runs.


def windowed(rewards: list[float], k: int) -> float:
    """The mean reward of the ``WINDOW`` steps ending at step ``k`` (1-based)."""
    return mean(rewards[max(0, k - WINDOW) : k])


def summarize(rows: list[dict], wall: float) -> dict:
    rewards = [r["reward/mean"] for r in rows]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    reach = {}
    for thr in THRESHOLDS:
        reach[thr] = next((k for k in range(1, len(rewards) + 1) if windowed(rewards, k) >= thr), None)
    loop_s = rows[-1]["time/elapsed"] if rows else 0.0
    return {
        "steps": len(rows),
        "rewards": rewards,
        "reach": reach,
        "wall_s": wall,
        "s_per_step": loop_s / max(1, len(rows)),
        "kl_first": kl[0] if kl else None,
        "kl_last": kl[-1] if kl else None,
        "teacher_wait_s": mean(r.get("perf/teacher_wait_s", 0.0) for r in rows),
    }


def _f(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_tables(results: dict[str, dict]) -> None:
    steps = max(r["steps"] for r in results.values())
    cps = [k for k in CHECKPOINTS if k <= steps]
    if steps not in cps:
        cps.append(steps)
    print(f"\nreward/mean at step k (mean of steps k-{WINDOW - 1}..k); reach: first step whose {WINDOW}-step mean >= x")
    head = ["arm", "steps", *(f"reward @{k}" for k in cps), *(f"steps to {t}" for t in THRESHOLDS)]
    head += ["wall s", "s/step", "distill/reverse_kl first", "last"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for arm, r in results.items():
        cells = [arm, str(r["steps"]), *(_f(windowed(r["rewards"], k)) if k <= r["steps"] else "-" for k in cps)]
        cells += [str(r["reach"][t]) if r["reach"][t] is not None else f"> {r['steps']}" for t in THRESHOLDS]
        cells += [f"{r['wall_s']:.0f}", f"{r['s_per_step']:.2f}", _f(r["kl_first"]), _f(r["kl_last"])]
        print("| " + " | ".join(cells) + " |")
    stride = max(1, math.ceil(steps / 20))
    cols = list(range(1, steps + 1, stride))
    if cols[-1] != steps:
        cols.append(steps)
    print(f"\nreward/mean per step (same seeds; every {stride} step(s))")
    print("| arm | " + " | ".join(str(k) for k in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for arm, r in results.items():
        print(
            f"| {arm} | " + " | ".join(_f(r["rewards"][k - 1], ".2f") if k <= r["steps"] else "-" for k in cols) + " |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="train.steps of every arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--task", default="last_digit", help="data.task (built-in): last_digit, add_digits")
    p.add_argument("--seed", type=int, default=1234, help="the student's seed (every arm)")
    p.add_argument("--teacher", default=None, help="an HF teacher directory (skips the SFT)")
    p.add_argument("--teacher-steps", type=int, default=200, help="SFT steps of the teacher")
    p.add_argument("--teacher-seed", type=int, default=0)
    p.add_argument(
        "--distill-dynamic-sampling",
        action="store_true",
        help="keep rollout.dynamic_sampling=true in the distillation-alone arm (default: false there)",
    )
    p.add_argument("--coef", type=float, default=1.0, help="distill.coef of the distill and mix arms")
    p.add_argument("--loss", default="reverse_kl", help="distill.loss of the distill and mix arms")
    p.add_argument("--topk", type=int, default=8, help="distill.topk with a top-k --loss")
    p.add_argument(
        "--gspo-teacher",
        action="store_true",
        help="the gspo arm with the teacher at distill.coef=0 (its distill/reverse_kl measured; the scoring in its time)",
    )
    p.add_argument("--override", action="append", default=[], help="one more key=value for every arm")
    p.add_argument("--no-check", action="store_true", help="skip the engine vs transformers log-prob check")
    p.add_argument("--quick", action="store_true", help="3 steps per arm, a 100-step teacher (CI)")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.teacher_steps = 3, 100
    arms = [x for x in a.arms.split(",") if x]
    if not arms or any(x not in ARMS for x in arms):
        p.error(f"--arms: a comma-separated subset of {','.join(ARMS)}")
    root = a.out or tempfile.mkdtemp(prefix="gspo-distill-bench-")
    os.makedirs(root, exist_ok=True)

    teacher = a.teacher
    if teacher is None:
        t0 = time.time()
        teacher = sft_teacher(os.path.join(root, "teacher"), task=a.task, steps=a.teacher_steps, seed=a.teacher_seed)
        print(f"teacher: {a.teacher_steps} SFT steps in {time.time() - t0:.1f} s", flush=True)
    teacher = os.path.abspath(teacher)
    try:
        rep = read_report(teacher)
        where = "held-out" if rep["held_out"] else "seen"
        print(f"teacher {teacher}: greedy accuracy {rep['accuracy']:.3f} on {rep['n']} {where} rows", flush=True)
    except FileNotFoundError:
        print(f"teacher {teacher} (no sft_report.json)", flush=True)

    check = None
    if not a.no_check:
        check = check_teacher_logprobs(teacher, os.path.join(root, "check"), task=a.task, seed=a.seed)
        print(
            f"teacher log-probs, CPU-server engine vs transformers fp32: max |diff| {check['max_abs_diff']:.2e} over "
            f"{check['tokens']} log-probs of {check['sequences']} sequences, ids match: {check['ids_match']}, every "
            f"response token scored: {check['covered']} -> {'PASS' if check['ok'] else 'FAIL'} (< {LOGPROB_TOL:g}); "
            f"server up in {check['start_s']:.1f} s",
            flush=True,
        )

    results = {}
    for arm in arms:
        rows, wall = train(os.path.join(root, arm), arm_overrides(arm, teacher, a))
        results[arm] = summarize(rows, wall)
        print(f"{arm}: {len(rows)} steps in {wall:.0f} s (start-up included)", flush=True)
    print_tables(results)
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(
            {
                "check": check,
                "arms": {k: {**v, "reach": {str(t): s for t, s in v["reach"].items()}} for k, v in results.items()},
            },
            f,
        )
    print(f"\nruns in {root}")
    return 0 if check is None or check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
