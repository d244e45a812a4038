"""gspo-train's command line: --help documents the config, --check validates, bad settings fail in
seconds naming the field in one line without a traceback, before any model is built (no model: no
hf_init directory is written)."""

import os
import sys

from subprocess_utils import run_group

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(*args, env=None):
    return run_group(
        [sys.executable, "-m", "gspo_megatron.train", *args], timeout=120, cwd=REPO, env=dict(os.environ, **(env or {}))
    )


def test_help_lists_every_section_and_interface_key():
    proc = _run("--help")
    assert proc.returncode == 0
    for key in (
        "output_dir",
        "train.steps",
        "data.path",
        "data.prompt_key",
        "data.label_key",
        "reward.function",
        "checkpoint.interval",
        "seed",
        "gspo.clip_low",
        "parallel.ep",
    ):
        assert key in proc.stdout, key


def test_check_accepts_the_demo_config():
    proc = _run("--config", "configs/demo_cpu.yaml", "--check")
    assert proc.returncode == 0, proc.stderr
    assert "config OK" in proc.stdout


def test_bad_settings_fail_fast_naming_the_field(tmp_path):
    cases = [
        (["gspo.clip_low=0"], "gspo.clip_low"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["parallel.tp=3"], "parallel.tp"),
        (["rollout.grup_size=4"], "did you mean"),
        ([f"data.path={tmp_path}/missing.jsonl"], "data.path"),
    ]
    for overrides, expected in cases:
        proc = _run("--config", "configs/demo_cpu.yaml", f"output_dir={tmp_path}/run", *overrides)
        assert proc.returncode != 0, overrides
        assert expected in proc.stderr, (overrides, proc.stderr[-2000:])
        # one line, no traceback (the traceback only with --debug)
        assert "Traceback" not in proc.stderr, (overrides, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gspo-train: error: "), (overrides, proc.stderr[-2000:])
        assert not os.path.exists(tmp_path / "run" / "hf_init"), "failed before building anything"


def test_world_size_that_does_not_divide_the_layout_is_refused(tmp_path):
    proc = _run(
        "--config", "configs/demo_cpu.yaml", f"output_dir={tmp_path}/run", "parallel.ep=2", env={"WORLD_SIZE": "3"}
    )
    assert proc.returncode != 0
    assert "parallel.ep" in proc.stderr or "world size" in proc.stderr


def test_first_screen_is_ours_and_known_warnings_only_with_debug(tmp_path):
    """A demo run opens with gspo-train's own lines: the known third-party warnings (Megatron's
    "Transformer Engine and Apex are not installed", ...; runtime/known_warnings.py) are replaced
    by one line of ours and appear only with --debug; the ones our own calls caused are gone."""
    import subprocess

    fast = [
        "train.steps=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "parallel.micro_batch_size=4",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.interval=0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    outputs = {}
    for debug in (False, True):
        args = ["--debug"] * debug + [
            "--config",
            "configs/demo_cpu.yaml",
            f"output_dir={tmp_path}/run{int(debug)}",
            *fast,
        ]
        proc = run_group(
            [sys.executable, "-m", "gspo_megatron.train", *args],
            timeout=300,
            cwd=REPO,
            env=env,
            stderr=subprocess.STDOUT,
        )
        assert proc.returncode == 0, proc.stdout[-4000:]
        outputs[debug] = proc.stdout
    lines = outputs[False].splitlines()
    assert lines[0].startswith("[gspo-train] CPU path: ") and "--debug shows them" in lines[0], lines[:5]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/1 "))
    assert all(line.startswith("[gspo-train] ") for line in lines[:first_step]), lines[: first_step + 1]
    assert "Warning" not in outputs[False], outputs[False][:3000]
    assert "Transformer Engine and Apex are not installed" in outputs[True]
    for message in ("The .grad attribute of a Tensor that is not a leaf", "is deprecated. Please use `torch"):
        assert message in outputs[True], message
    assert "cuda_graph_scope" not in outputs[True]  # fixed where we build the Megatron config
