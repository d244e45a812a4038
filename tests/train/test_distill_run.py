"""On-policy distillation (issue 36) the way a user runs it: ``gspo-train`` under torchrun with a
teacher that the run starts from its directory as a CPU-server engine (``distill.teachers=['t=DIR']``,
``rollout.engine_server=cpu``), scoring every sampled token by prefill over HTTP.

- the student learns the teacher's task faster than GSPO alone on the same seeds (two ranks, EP2);
- ``distill.coef=0`` with a teacher scoring is plain GSPO bitwise (losses, gradient norms, weights);
- bad input: a teacher that does not answer is one line before any model is built; a teacher that
  dies during the run stops it with one line naming it, and the checkpoint written before stays.

The teacher is the demo's tiny model fine-tuned on the task's correct answers
(``bench/distill_teacher.py``, ~10 s)."""

from __future__ import annotations

import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from gspo_megatron.runtime.ports import free_port
from subprocess_utils import popen_group
from train_utils import REPO, read_metrics, run_train, train_cmd, train_env

STEPS = 24
COMMON = [
    "rollout.engine_server=cpu",  # the teacher's server kind (the student's engine stays in-process)
    "rollout.prompts_per_step=8",
    "rollout.dynamic_sampling=false",
    "gspo.mini_batches=1",
]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("teacher") / "t")
    _bench("distill_teacher").sft_teacher(out, task="last_digit", seed=0)
    return out


def mean_reward(rows, lo, hi) -> float:
    return statistics.mean(r["reward/mean"] for r in rows[lo:hi])


def test_distillation_two_ranks_learns_faster_than_gspo_alone(tmp_path, teacher):
    """torchrun, 2 ranks (EP2), the demo's settings, the teacher a CPU server the run starts: with the
    teacher's top-k forward KL mixed into GSPO, the fresh student's reward over the last steps is
    well above GSPO alone's on the same seeds, and its reverse KL to the teacher falls (the
    sampled-token ``reverse_kl`` does not beat GSPO from a random student: docs/bench.md)."""
    curves = {}
    for arm, extra in {
        "gspo": [],
        "mix": [
            f"distill.teachers=['t={teacher}']",
            "distill.coef=1.0",
            "distill.loss=topk_forward_kl",
            "distill.topk=8",
        ],
    }.items():
        out = str(tmp_path / arm)
        demo = ["rollout.engine_server=cpu", "checkpoint.interval=0", f"train.steps={STEPS}", "parallel.ep=2"]
        run_train(out, [*demo, *extra], nproc=2, timeout=900)
        curves[arm] = read_metrics(out)
    gspo, mix = curves["gspo"], curves["mix"]
    assert len(gspo) == len(mix) == STEPS
    assert "distill/reverse_kl" not in gspo[0]
    for r in mix:
        assert r["distill/tokens"] > 0 and r["distill/reverse_kl/t"] == r["distill/reverse_kl"], r
        assert "loss/distill_reverse_kl" in r, r
    kl = [r["distill/reverse_kl"] for r in mix]
    assert statistics.mean(kl[-3:]) < 0.8 * statistics.mean(kl[:3]), kl
    assert mean_reward(mix, STEPS - 5, STEPS) > 1.5 * mean_reward(gspo, STEPS - 5, STEPS) + 0.02, (
        [r["reward/mean"] for r in mix],
        [r["reward/mean"] for r in gspo],
    )


def test_coef_zero_is_plain_gspo_bitwise(tmp_path, teacher):
    """A teacher scoring with ``distill.coef=0`` changes nothing the student learns: the same losses,
    gradient norms and final weights as the run without a teacher (the metrics show the teacher)."""
    runs = {}
    for arm, extra in {"gspo": [], "coef0": [f"distill.teachers=['t={teacher}']", "distill.coef=0"]}.items():
        out = str(tmp_path / arm)
        run_train(out, [*COMMON, *extra, "train.steps=3"])
        runs[arm] = (read_metrics(out), load_file(os.path.join(out, "hf_final", "model.safetensors")))
    (m0, w0), (m1, w1) = runs["gspo"], runs["coef0"]
    for a, b in zip(m0, m1):
        for key in ("loss/total", "loss/policy", "train/grad_norm", "reward/mean", "gspo/ratio_mean"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert "distill/reverse_kl" in m1[0] and "loss/distill_reverse_kl" not in m1[0]
    assert w0.keys() == w1.keys() and all(w0[k].equal(w1[k]) for k in w0)


def _one_line_error(proc) -> str:
    err = [line for line in proc.stderr.splitlines() if line.startswith("gspo-train: error:")]
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return err[0]


def test_a_teacher_that_does_not_answer_is_one_line_before_any_model(tmp_path):
    out = tmp_path / "run"
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_train(str(out), [*COMMON, f"distill.teachers=['t={url}']", "distill.coef=1"], check=False)
    line = _one_line_error(proc)
    assert f"distill.teachers (t): the teacher at {url} does not answer" in line
    assert not (out / "hf_init").exists() and not (out / "checkpoints").exists()


def test_a_teacher_that_dies_stops_the_run_with_one_line_and_keeps_the_checkpoint(tmp_path, teacher):
    """The teacher server (started by the run) is killed after the step-2 checkpoint: the next
    scoring fails, the run ends with one line naming the teacher and ``distill.timeout_s``, and the
    checkpoint is still there."""
    out = tmp_path / "run"
    overrides = [
        *COMMON,
        f"distill.teachers=['t={teacher}']",
        "distill.coef=1",
        "distill.timeout_s=20",
        "checkpoint.interval=2",
        "train.steps=50",
        "logging.progress=false",
    ]
    cmd = train_cmd(str(out), overrides)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with popen_group(cmd, cwd=REPO, env=train_env(), **pipes) as proc:  # the group goes with it, teacher included
        deadline = time.monotonic() + 300
        while not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        pid = _server_pid(out / "teachers" / "t-0.log")
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    line = _one_line_error(result)
    assert "distill.teachers (t)" in line and "distill.timeout_s" in line, line
    assert any((out / "checkpoints").iterdir())


def _server_pid(log) -> int:
    """The teacher server's pid: the process listening on the port its log names."""
    import re

    import psutil

    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text()).group(1))
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on {port}")


def test_several_teachers_routed_by_a_data_column(tmp_path, teacher):
    """NeMo-RL's MOPD: two teachers (each its own CPU server), every prompt routed by its ``domain``
    column; each teacher's reverse KL is reported."""
    import json

    from gspo_megatron.data.tasks import get_task

    rows = get_task("last_digit").rows(64, 0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({**r, "domain": "ab"[i % 2]}) + "\n" for i, r in enumerate(rows)))
    out = str(tmp_path / "run")
    teachers = f"distill.teachers=['a={teacher}','b={teacher}']"
    run_train(
        out, [*COMMON, teachers, "distill.coef=1", "distill.teacher_key=domain", f"data.path={data}", "train.steps=2"]
    )
    for r in read_metrics(out):
        assert r["distill/reverse_kl/a"] > 0 and r["distill/reverse_kl/b"] > 0, r
        assert r["distill/tokens"] > 0
        assert 0 <= r["distill/clip_frac"] <= 1, r  # the default sampled-token reverse_kl is clipped


def test_inflight_updates_with_a_teacher(tmp_path, teacher):
    """Engines that never drain (``rollout.inflight_updates=retract``, a disaggregated CPU-server
    student engine): each finished group is scored by the teacher in its producer worker."""
    out = str(tmp_path / "run")
    inflight = [
        "rollout.engine=sglang",
        "rollout.sync_mode=disaggregated",
        "rollout.num_engines=1",
        "rollout.max_staleness=2",
        "rollout.inflight_updates=retract",
        "rollout.inflight_groups=16",
    ]
    run_train(out, [*COMMON, *inflight, f"distill.teachers=['t={teacher}']", "distill.coef=1", "train.steps=3"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["distill/tokens"] > 0 and "loss/distill_reverse_kl" in r, r
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
