"""Launch scripts: syntax (bash -n), shellcheck when installed, and their behaviour with fake
torchrun / srun / scontrol executables (argument passing, node placement, signal forwarding)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from subprocess_utils import popen_group

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "launch/torchrun.sh", ROOT / "launch/sglang_node.sh", ROOT / "launch/slurm/train.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    res = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_torchrun_passes_rendezvous_and_args(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    fake = _exe(tmp_path / "torchrun", 'printf "%s\\n" "$@" > "$OUT"\n')
    env = {
        **os.environ,
        "TORCHRUN": str(fake),
        "OUT": str(tmp_path / "args"),
        "NNODES": "4",
        "NODE_RANK": "2",
        "MASTER_ADDR": "node7",
        "NPROC_PER_NODE": "8",
    }
    env.pop("MASTER_PORT", None)
    subprocess.run([str(SCRIPTS[0]), str(cfg), "rollout.n=8", "x=1 2"], env=env, check=True, capture_output=True)
    args = (tmp_path / "args").read_text().splitlines()
    assert args == [
        "--nnodes",
        "4",
        "--node-rank",
        "2",
        "--nproc-per-node",
        "8",
        "--master-addr",
        "node7",
        "--master-port",
        "29500",
        "-m",
        "gspo_megatron.train",
        "--config",
        str(cfg),
        "rollout.n=8",
        "x=1 2",
    ]


def test_torchrun_rejects_missing_config(tmp_path):
    res = subprocess.run(
        [str(SCRIPTS[0]), str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHRUN": "/bin/true"},
    )
    assert res.returncode == 2 and "config file not found" in res.stderr


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep (procps) not installed")
def test_torchrun_forwards_usr1_to_training_processes(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    marker = tmp_path / "checkpointed"
    # fake torchrun: one "training process" that checkpoints (writes a marker) on USR1 and exits
    fake = _exe(
        tmp_path / "torchrun",
        'bash -c \'trap "echo ckpt > $MARK; exit 0" USR1; touch $MARK.ready; '
        "while true; do sleep 0.05; done' &\nwait $!\n",
    )
    env = {**os.environ, "TORCHRUN": str(fake), "MARK": str(marker), "NPROC_PER_NODE": "1"}
    with popen_group([str(SCRIPTS[0]), str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        deadline = time.monotonic() + 20
        while not Path(str(marker) + ".ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=20) == 0
    assert marker.read_text().strip() == "ckpt"


def _fake_slurm(tmp_path: Path, nodes: list[str], run_training: bool = False, run_teacher: bool = False) -> dict:
    """Fake scontrol / srun on PATH. ``run_training``: the training step is run (its task command,
    as node 0), with a fake torchrun (``TORCHRUN``) that runs gspo-train's config checks on the
    training nodes' GPUs: ``--dry-run --nodes NNODES --gpus-per-node NPROC_PER_NODE`` (the config tiers
    of ``--check`` that need no model files: static, world size, model layout; exit 2 on a bad config).
    ``run_teacher``: the teacher's step (TEACHER_MODEL) is run too, its task command as one node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(
        bin_dir / "scontrol",
        'if [[ "$1 $2" == "show hostnames" ]]; then printf "%s\\n" '
        + " ".join(nodes)
        + '; else echo "scontrol $*" >> "$SRUN_LOG"; fi\n',
    )
    # ignores TERM: the script stops the background SGLang (and teacher) steps once training ends.
    # Like a real training step, the fake one lasts until those steps have started (they log first),
    # so the TERM never reaches a fake that has not yet logged its call.
    _exe(
        bin_dir / "srun",
        'trap "" TERM\necho "srun $* NNODES=${NNODES:-} MASTER_ADDR=${MASTER_ADDR:-} '
        'URLS=${GSPO_SGLANG_URLS:-} CFG=${GSPO_CONFIG:-} CFGO=${GSPO_CONFIG_OVERRIDES:-}" >> "$SRUN_LOG"\n'
        'if [[ "$*" == *torchrun.sh* ]]; then\n'
        '  want=0; [[ -n "${GSPO_SGLANG_URLS:-}" ]] && want=$((want + 1)); [[ -n "${TEACHER_MODEL:-}" ]] && want=$((want + 1))\n'
        '  for _ in $(seq 200); do [[ "$(grep -c sglang_node.sh "$SRUN_LOG")" -ge $want ]] && break; sleep 0.05; done\nfi\n'
        + (
            'if [[ "$*" == */teacher-*node%t.log* ]]; then\n  while [[ "$1" == --* ]]; do shift; done\n  exec "$@"\nfi\n'
            if run_teacher
            else ""
        )
        + (
            'if [[ "$*" == *torchrun.sh* ]]; then\n'
            '  while [[ "$1" == --* ]]; do shift; done\n'
            '  export SLURM_PROCID=0\n  exec "$@"\nfi\n'
            if run_training
            else ""
        ),
    )
    extra = {}
    if run_training:
        # torchrun --nnodes N --node-rank R --nproc-per-node G ... -m gspo_megatron.train ARGS
        _exe(
            bin_dir / "fake_torchrun",
            f'exec "{sys.executable}" -W ignore -m gspo_megatron.train --dry-run '
            '--nodes "$2" --gpus-per-node "$6" --gpu-memory-gb "${GPU_MEMORY_GB:-80}" "${@:13}"\n',
        )
        extra = {"TORCHRUN": str(bin_dir / "fake_torchrun")}
    return {
        **os.environ,
        **extra,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_JOB_ID": "42",
        "SLURM_GPUS_PER_NODE": "h100:4",
        "SRUN_LOG": str(tmp_path / "srun.log"),
        "GSPO_ROOT": str(ROOT),
        "LOG_DIR": str(tmp_path / "logs"),
    }


def test_sbatch_disaggregated_places_engines_on_last_nodes(tmp_path):
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3"])
    env.update(ROLLOUT_MODE="disaggregated", SGLANG_NODES="1", SGLANG_TP="2", MODEL_PATH="/m")
    subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml", "a=1"], env=env, check=True, capture_output=True)
    lines = (tmp_path / "srun.log").read_text().splitlines()
    sgl = next(line for line in lines if "sglang_node.sh" in line)
    train = next(line for line in lines if "torchrun.sh" in line)
    assert "--nodelist=n3" in sgl and "--nodes=1" in sgl
    assert "--nodelist=n1,n2" in train and "NNODES=2" in train and "MASTER_ADDR=n1" in train
    urls = "http://n3:30000,http://n3:30010"  # 4 GPUs / TP 2 = 2 engines
    assert f"rollout.engine_urls=[{urls}]" in train and "rollout.router_url=http://n3:30100" in train
    assert f"URLS={urls}" in train and "cfg.yaml a=1" in train
    # the engines get the config and the same overrides (launch/sglang_node.sh derives their flags)
    assert "CFG=cfg.yaml" in sgl and f"CFGO=a=1 rollout.engine_urls=[{urls}] rollout.sync_mode=disaggregated" in sgl


def test_sglang_node_starts_engines_with_the_flags_the_config_needs(tmp_path):
    """GSPO_CONFIG: the engine command line carries what fleet/engine_args.py derives (here r3's
    --enable-return-routed-experts and --ep-size); a bad config stops the script before any engine."""
    log = tmp_path / "engine.log"
    fake = tmp_path / "python"
    _exe(
        fake,
        f'if [[ "$2" == gspo_megatron.fleet.engine_args ]]; then exec "{sys.executable}" -W ignore "$@"; fi\n'
        f'echo "$*" >> "{log}"\n',
    )
    demo = str(ROOT / "configs/demo_cpu.yaml")
    overrides = "rollout.engine=sglang rollout.engine_server=cpu rollout.sync_mode=disaggregated rollout.num_engines=1 "
    env = dict(
        os.environ,
        PYTHON=str(fake),
        MODEL_PATH="/m",
        NUM_ENGINES="1",
        SGLANG_TP="2",
        LOG_DIR=str(tmp_path / "logs"),
        GSPO_CONFIG=demo,
        GSPO_CONFIG_OVERRIDES=overrides + "rollout.routing_replay=r3 rollout.engine_tp=2 rollout.engine_ep=2",
    )
    res = subprocess.run(["bash", str(SCRIPTS[1])], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (line,) = log.read_text().splitlines()
    assert "--tp-size 2" in line and "--ep-size 2 --enable-return-routed-experts" in line, line
    env["GSPO_CONFIG_OVERRIDES"] = "rollout.routing_replay=r3"  # the in-process engine returns no routes
    log.unlink()
    res = subprocess.run(["bash", str(SCRIPTS[1])], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and not log.exists()
    assert "engine_args: error: rollout.routing_replay=r3" in res.stderr


def test_sbatch_colocated_trains_everywhere_and_checks_mode(tmp_path):
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3"])
    subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, check=True, capture_output=True)
    lines = (tmp_path / "srun.log").read_text().splitlines()
    assert len(lines) == 1 and "--nodelist=n1,n2,n3" in lines[0] and "NNODES=3" in lines[0]
    env["ROLLOUT_MODE"] = "both"
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "ROLLOUT_MODE" in res.stderr
    env.update(ROLLOUT_MODE="disaggregated", SGLANG_NODES="3", MODEL_PATH="/m")
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "SGLANG_NODES=3" in res.stderr


def test_sbatch_output_file_needs_no_directory():
    """Slurm opens --output before the script runs: a directory in it must exist at submission, which
    a fresh checkout has not (the script's own mkdir comes too late). The batch log goes to the
    submit directory instead; the steps' logs go under LOG_DIR, which the script creates."""
    lines = [line for line in SCRIPTS[2].read_text().splitlines() if line.startswith("#SBATCH --output=")]
    assert len(lines) == 1
    assert os.path.dirname(lines[0].split("=", 1)[1]) == "", lines[0]


# GPU recipes and the training nodes they are planned for (their header); one more node runs SGLang
RECIPES = {
    "qwen3_30b_a3b_gspo": 2,
    "qwen3_30b_a3b_grpo": 2,
    "mixtral_8x7b_gspo": 2,
    "qwen3_235b_a22b_gspo": 8,
    "glm45_355b_gspo": 16,
    "deepseek_v3_671b_gspo": 32,
    "minimax_m2_gspo": 8,
    "qwen3_5_35b_a3b_gspo": 1,
    "qwen3_5_397b_a17b_gspo": 16,
    "deepseek_v32_gspo": 32,
    "glm5_gspo": 32,
    "qwen3_30b_a3b_gspo_lora": 1,
}


def _recipe_header(recipe: str) -> tuple[int, int, bool]:
    """(nodes, GPU memory in GB, FP8 sync) as the recipe's own planner line and config state them."""
    text = (ROOT / "configs" / f"{recipe}.yaml").read_text()
    plan = re.search(r"tools/plan\.py .*--nodes (\d+) .*--gpu-memory-gb (\d+)", text)
    assert plan, f"{recipe}: no planner line in the header"
    return int(plan.group(1)), int(plan.group(2)), re.search(r"^\s+sync_fp8: true", text, re.M) is not None


def test_every_gpu_recipe_is_covered():
    shipped = {
        p.stem
        for p in (ROOT / "configs").glob("*.yaml")
        if "engine: sglang" in p.read_text() and "engine_server: cpu" not in p.read_text()
    }
    assert shipped == set(RECIPES)
    assert {r: _recipe_header(r)[0] for r in RECIPES} == RECIPES  # the table agrees with the headers


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sbatch_disaggregated_recipe_passes_the_config_checks(tmp_path, recipe):
    """ROLLOUT_MODE=disaggregated with a shipped (colocated) recipe: the overrides the script adds
    (engine URLs, router, sync_mode, offload_train, engine_tp, num_engines) make a config the trainer
    accepts on the training nodes; a recipe that syncs FP8 (DeepSeek-V3, V3.2, GLM-5), which attached engines cannot load,
    and is refused in one line naming the fields."""
    train_nodes, memory_gb, sync_fp8 = _recipe_header(recipe)
    nodes = [f"n{i}" for i in range(1, train_nodes + 2)]
    env = _fake_slurm(tmp_path, nodes, run_training=True)
    env.update(
        ROLLOUT_MODE="disaggregated",
        SGLANG_NODES="1",
        SGLANG_TP="8",
        MODEL_PATH="/m",
        SLURM_GPUS_PER_NODE="h100:8",
        GPU_MEMORY_GB=str(memory_gb),
    )
    res = subprocess.run(
        ["bash", str(SCRIPTS[2]), str(ROOT / "configs" / f"{recipe}.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    train = next(line for line in (tmp_path / "srun.log").read_text().splitlines() if "torchrun.sh" in line)
    assert f"NNODES={train_nodes}" in train and f"rollout.engine_urls=[http://n{train_nodes + 1}:30000]" in train
    if sync_fp8:
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        assert res.returncode == 2 and len(errors) == 1, out[-3000:]
        assert "rollout.sync_fp8=true is not supported with rollout.engine_urls" in errors[0]
        return
    assert res.returncode == 0, out[-3000:]
    assert "error" not in out.lower() and "Traceback" not in out, out[-3000:]
    gpus = 8 * train_nodes
    assert f"{train_nodes} node(s) x 8 GPUs = {gpus}," in out, out[-3000:]  # the training nodes only
    assert f"{gpus} training ranks; rollout: 1 external engine(s) (disaggregated)" in out, out[-3000:]


def test_sbatch_disaggregated_refuses_engines_larger_than_a_node(tmp_path):
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3"])
    env.update(ROLLOUT_MODE="disaggregated", SGLANG_NODES="1", SGLANG_TP="8", MODEL_PATH="/m")  # 4 GPUs a node
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "SGLANG_TP=8 must divide the 4 GPUs of a node" in res.stderr


def _teacher_urls(train_line: str) -> list[str]:
    """The distill.teachers override the trainer got, loaded as the trainer loads it: one entry."""
    from gspo_megatron.config import load_config
    from gspo_megatron.features.distill import parse_teachers

    args = train_line.split(" NNODES=", 1)[0]  # the step's command line (the fake srun logs env after it)
    (override,) = re.findall(r"distill\.teachers=\S+", args)
    specs, errors = parse_teachers(load_config(None, [override]).distill.teachers)
    assert not errors and len(specs) == 1 and specs[0].name == "teacher" and not specs[0].started_here, override
    return list(specs[0].urls)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_sbatch_teacher_on_the_last_nodes(tmp_path, mode):
    """TEACHER_MODEL: the teacher's sglang servers (launch/sglang_node.sh with the teacher's model, TP,
    ports and memory fraction, none of the student's flags, no router) run on the last TEACHER_NODES
    nodes, the student's SGLang nodes (disaggregated) before them, training on the rest; the trainer
    gets distill.teachers=['teacher=URL,URL,...'], one entry with one URL per teacher server."""
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3", "n4"])  # 4 GPUs a node
    env.update(ROLLOUT_MODE=mode, TEACHER_MODEL="/teacher", TEACHER_NODES="2", TEACHER_TP="2", TEACHER_PORT="31000")
    if mode == "disaggregated":
        env.update(SGLANG_NODES="1", SGLANG_TP="4", MODEL_PATH="/student")
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml", "a=1"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "srun.log").read_text().splitlines()
    (teacher,) = [line for line in lines if "/teacher-42-node%t.log" in line]
    train = next(line for line in lines if "torchrun.sh" in line)
    assert "--nodelist=n3,n4" in teacher and "--nodes=2" in teacher and "sglang_node.sh" in teacher
    for want in ("-u GSPO_CONFIG ", "-u GSPO_CONFIG_OVERRIDES ", "-u START_ROUTER ", "MODEL_PATH=/teacher "):
        assert want in teacher, teacher
    for want in ("SGLANG_TP=2 ", "SGLANG_PORT=31000 ", "SGLANG_MEM_FRACTION=0.85 ", "NUM_ENGINES=2 "):
        assert want in teacher, teacher
    urls = ["http://n3:31000", "http://n3:31010", "http://n4:31000", "http://n4:31010"]  # 4 GPUs / TP 2 = 2 a node
    assert _teacher_urls(train) == urls
    assert f"distill.teachers=['teacher={','.join(urls)}']" in train
    if mode == "colocated":
        assert len(lines) == 2 and "--nodelist=n1,n2 " in train and "NNODES=2" in train
    else:
        (sgl,) = [line for line in lines if "/sglang-42-node%t.log" in line]
        assert "--nodelist=n2 " in sgl and "MODEL_PATH" not in sgl  # the student's: its own env, untouched
        assert "--nodelist=n1 " in train and "NNODES=1" in train and "rollout.engine_urls=[http://n2:30000]" in train
        assert "distill.teachers=" in sgl.split("CFGO=", 1)[1]  # the student's engines see the trainer's config


def test_sbatch_teacher_step_starts_only_the_teacher_servers(tmp_path):
    """The teacher's step as a node runs it: launch/sglang_node.sh starts TEACHER_TP-GPU servers of
    TEACHER_MODEL on TEACHER_PORT + 10*i with TEACHER_MEM_FRACTION, and none of the student's engine
    flags even where GSPO_CONFIG is in the submitting environment."""
    engine_log = tmp_path / "engines.log"
    fake_python = _exe(tmp_path / "python", f'echo "$*" >> "{engine_log}"\n')
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3"], run_teacher=True)
    env.update(
        TEACHER_MODEL="/teacher",
        TEACHER_TP="2",
        TEACHER_PORT="32000",
        TEACHER_MEM_FRACTION="0.7",
        TEACHER_NAME="math",
        PYTHON=str(fake_python),
        GSPO_CONFIG=str(ROOT / "configs/demo_cpu.yaml"),
        START_ROUTER="1",
        SGLANG_EXTRA_ARGS="--student-only",
    )
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    engines = engine_log.read_text().splitlines()
    assert len(engines) == 2 and not any("engine_args" in e or "router" in e for e in engines), engines
    for i, line in enumerate(sorted(engines, key=lambda e: "--port 32010" in e)):
        assert line.startswith("-m sglang.launch_server --model-path /teacher --host 0.0.0.0"), line
        assert f"--port {32000 + 10 * i} --tp-size 2 --base-gpu-id {2 * i} --mem-fraction-static 0.7" in line
        assert "--student-only" not in line
    train = next(line for line in (tmp_path / "srun.log").read_text().splitlines() if "torchrun.sh" in line)
    assert "--nodelist=n1,n2 " in train and "distill.teachers=['math=http://n3:32000,http://n3:32010']" in train


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"TEACHER_NODES": "3"}, "TEACHER_NODES=3 leaves no training node out of 3"),
        ({"TEACHER_NODES": "0"}, "TEACHER_NODES=0 must be a number of nodes >= 1"),
        (
            {"TEACHER_NODES": "2", "ROLLOUT_MODE": "disaggregated", "MODEL_PATH": "/m"},
            "SGLANG_NODES=1 leaves no training node out of 1 node(s) left by TEACHER_NODES=2",
        ),
        ({"TEACHER_TP": "3"}, "TEACHER_TP=3 must divide the 4 GPUs of a node"),
        ({"TEACHER_TP": "8"}, "TEACHER_TP=8 must divide the 4 GPUs of a node"),
        ({"TEACHER_NAME": "a=b"}, "TEACHER_NAME='a=b' must be letters, digits"),
    ],
)
def test_sbatch_teacher_refusals(tmp_path, extra, message):
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3"])  # 4 GPUs a node
    env.update(TEACHER_MODEL="/teacher", **extra)
    res = subprocess.run(["bash", str(SCRIPTS[2]), "cfg.yaml"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == res.stderr.strip().splitlines()[0], res.stderr
    assert message in res.stderr and not (tmp_path / "srun.log").exists()


def test_sbatch_teacher_override_passes_the_trainer_checks(tmp_path):
    """A shipped recipe with TEACHER_MODEL and distill.coef=1: the trainer's config checks (run on the
    training nodes) accept the distill.teachers override and the plan names the teacher's servers."""
    env = _fake_slurm(tmp_path, ["n1", "n2", "n3", "n4"], run_training=True)
    env.update(
        ROLLOUT_MODE="disaggregated",
        SGLANG_TP="8",
        MODEL_PATH="/m",
        SLURM_GPUS_PER_NODE="h100:8",
        TEACHER_MODEL="/t",
        TEACHER_TP="4",
    )
    recipe = str(ROOT / "configs/qwen3_30b_a3b_gspo.yaml")
    res = subprocess.run(
        ["bash", str(SCRIPTS[2]), recipe, "distill.coef=1"], env=env, capture_output=True, text=True, timeout=300
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "[train.sbatch] teacher teacher (/t) on n4: http://n4:31000 http://n4:31010" in out
    assert "training on n1 n2 " in out and "16 training ranks" in out, out[-3000:]
    assert "note: distill: teachers on their own servers (not counted here): teacher" in out, out[-3000:]
