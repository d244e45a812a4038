"""End to end through gspo-train (tiny CPU demo, few steps): eval metrics in metrics.jsonl and
TensorBoard at step 0, every eval.interval and the last step; a resumed run repeats no evaluation and
skips none; a run whose reward server hangs, errors and drops connections goes on, each fault costing
its round at most reward.timeout_s, counted in reward/timeouts and reward/errors."""

from __future__ import annotations

import json

from gspo_megatron.data.tasks import get_task
from train_utils import read_metrics, run_train


def _eval_steps(rows, key):
    return [r["step"] for r in rows if key in r]


def _tb_scalars(out_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_eval_metrics_tensorboard_and_resume_without_repeats(tmp_path):
    held = tmp_path / "held.jsonl"
    with open(held, "w") as f:
        for row in get_task("last_digit").rows(5, seed=77):
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "run"
    common = [
        "eval.interval=2",
        f"eval.datasets=[held={held},task:last_digit]",
        "eval.max_prompts=4",
        "eval.n=3",
        "eval.greedy=false",
        "eval.pass_k=[1,3]",
        "logging.tensorboard=true",
        "checkpoint.interval=2",
    ]
    proc = run_train(str(out), [*common, "train.steps=4"])
    rows = read_metrics(str(out))
    for name in ("held", "last_digit"):
        assert _eval_steps(rows, f"eval/{name}/pass@1") == [0, 2, 4]
    for r in rows:
        if "eval/held/pass@1" in r:
            assert 0 <= r["eval/held/pass@1"] <= r["eval/held/pass@3"] <= 1
            assert 0 <= r["eval/held/mean_reward"] <= 1 and r["eval/held/response_len_mean"] > 0
            assert r["eval/held/reward_failures"] == 0 and r["perf/eval_s"] > 0
    step0 = [r for r in rows if r["step"] == 0]
    assert len(step0) == 1 and "loss/policy" not in step0[0]  # step 0: the evaluation before training
    assert _tb_scalars(out, "eval/held/pass@3") == [0, 2, 4]

    # resume at step 4 (evaluated, checkpointed) and go on to 6: step 4 is due but already evaluated
    proc = run_train(str(out), [*common, "train.steps=6"])
    assert "resuming from step 4" in proc.stdout
    rows = read_metrics(str(out))
    assert _eval_steps(rows, "eval/held/pass@1") == [0, 2, 4, 6]
    assert _eval_steps(rows, "eval/last_digit/mean_reward") == [0, 2, 4, 6]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert _tb_scalars(out, "eval/held/pass@3") == [0, 2, 4, 6]


def test_training_goes_on_past_a_hanging_erroring_dropping_reward_server(serve, tmp_path):
    # 16 samples per step (one sampling round: no dynamic sampling) in 4 requests of 4, one at a time,
    # reward.retries=2.
    # step 1: request 2 hangs: the round's 3 s pass, its batch and the 2 not yet sent time out (12);
    # step 2: requests 3-5 answer HTTP 500 (one batch, 3 attempts), 7-9 drop the connection (another): 8 errors;
    # step 3: all answered.
    url, faults = serve(
        "last_digit", plan={2: "hang", 3: "error", 4: "error", 5: "error", 7: "drop", 8: "drop", 9: "drop"}
    )
    out = tmp_path / "remote"
    run_train(
        str(out),
        [
            f"reward.url={url}",
            "reward.batch_size=4",
            "reward.max_in_flight=1",
            "reward.timeout_s=3",
            "reward.retries=2",
            "rollout.dynamic_sampling=false",
        ],
    )
    rows = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3]
    got = [(r["reward/timeouts"], r["reward/errors"], r["reward/remote_retries"]) for r in rows]
    assert got == [(12.0, 0.0, 0.0), (0.0, 8.0, 4.0), (0.0, 0.0, 0.0)]
    assert [r["reward/remote_requests"] for r in rows] == [2.0, 8.0, 4.0] and faults.count == 14
    assert rows[-1]["loss/policy"] == rows[-1]["loss/policy"]  # a finite step after the faults


def test_eval_with_offload_train_keeps_the_engine_synced(tmp_path):
    # rollout.offload_train: each evaluation offloads the training state, the engine takes its KV
    # cache, then the engine is released, the state reloaded and the weights pushed again
    out = tmp_path / "offload"
    run_train(
        str(out),
        [
            "train.steps=2",
            "eval.interval=1",
            "eval.datasets=[task:last_digit]",
            "eval.max_prompts=4",
            "rollout.offload_train=true",
            "rollout.sync_verify=true",
            "rollout.sync_verify_every=1",
        ],
    )
    rows = read_metrics(str(out))
    assert _eval_steps(rows, "eval/last_digit/pass@1") == [0, 1, 2]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/logprob_abs_diff"] < 1e-3 for r in rows if r["step"] > 0)
