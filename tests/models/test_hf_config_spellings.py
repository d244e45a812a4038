"""HF config.json spellings of transformers 4.x and 5.x are read in one place (models/hf_config.py),
by the families, the planner, gspo-train (--check, --dry-run, training) and the conversion tools.

The 5.x directories are written by the pinned transformers (5.23) itself: Qwen3-MoE as 5.x saves it
has ``num_local_experts`` and ``rope_parameters`` (no ``num_experts``, no top-level ``rope_theta``),
sharded with ``model.safetensors.index.json`` as real checkpoints are. The 4.x spelling of the same
model is the family's tiny config (``num_experts``, top-level ``rope_theta``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from gspo_megatron.models import families, get_family, hf_config
from gspo_megatron.models.dims import ModelDims
from tiny_models import tiny_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAMILIES = [f.name for f in families()]


def test_accessors_read_every_spelling():
    v4 = {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    v5 = {
        "model_type": "qwen3_moe",
        "num_local_experts": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    ds = {"model_type": "deepseek_v3", "n_routed_experts": 8, "rope_theta": 1e6}
    for hf in (v4, v5, ds):
        assert hf_config.num_experts(hf) == 8
        assert hf_config.rope_theta(hf) == 1e6
    assert (
        hf_config.rope_parameters(v4)
        == hf_config.rope_parameters(v5)
        == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
    )
    assert hf_config.rope_type(ds) == "default" and hf_config.rope_theta({}) == 10000.0
    assert hf_config.num_experts({"num_experts": None}) == 0  # null is absent
    assert hf_config.head_dim({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None}) == 16
    assert hf_config.num_kv_heads({"num_attention_heads": 4}) == 4
    with pytest.raises(
        hf_config.HFConfigError, match="lacks 'num_experts' \\(or 'num_local_experts' \\(or 'n_routed_experts'\\)\\)"
    ):
        hf_config.get({"model_type": "qwen3_moe"}, "num_experts")
    with pytest.raises(hf_config.HFConfigError, match="nested per layer type"):
        hf_config.rope_parameters({"rope_parameters": {"full_attention": {"rope_theta": 1.0}}})


@pytest.fixture(scope="module")
def saved_v5(tmp_path_factory):
    """Every family's tiny model saved by transformers (5.23), sharded; name -> (dir, model)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("v5")
    out = {}
    for name in FAMILIES:
        d = str(root / name)
        out[name] = (d, save_tiny_hf_model(name, d, seed=5, max_shard_size="100KB"))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_family_reads_the_5x_config_as_the_4x_one(saved_v5, name):
    import transformers

    hf_dir, _ = saved_v5[name]
    v5 = hf_config.load_hf_config(hf_dir)
    family = get_family(v5)
    assert v5["transformers_version"] == transformers.__version__
    assert "rope_parameters" in v5 and "rope_theta" not in v5  # transformers 5.x spelling
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    v4 = tiny_hf_config(family.name)  # (qwen3_5_moe: model_type qwen3_5_moe_text)
    assert "rope_theta" in v4
    assert family.name == name and ModelDims.from_hf_config(v5) == ModelDims.from_hf_config(v4)
    assert family.config_fields(v5) == family.config_fields(v4)
    assert family.rotary_kwargs(v5) == family.rotary_kwargs(v4)


@pytest.mark.parametrize("name", FAMILIES)
def test_planner_counts_equal_transformers_parameters(saved_v5, name):
    """The planner's counts, from the family's dims, equal the parameters of transformers' model."""
    from gspo_megatron.planner import param_counts

    hf_dir, model = saved_v5[name]
    d = ModelDims.from_hf_config(hf_config.load_hf_config(hf_dir))
    c = param_counts(d)
    named = dict(model.named_parameters())
    gap = sum(p.numel() for p in named.values()) - c.total
    assert gap == 0
    assert c.expert == sum(p.numel() for n, p in named.items() if ".experts." in n and "shared" not in n)


def test_qwen3_moe_5x_spelling_is_the_one_that_blocked_users(saved_v5):
    v5 = hf_config.load_hf_config(saved_v5["qwen3_moe"][0])
    assert "num_local_experts" in v5 and "num_experts" not in v5
    assert ModelDims.from_hf_config(v5).num_experts == 4


def _run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _with_tokenizer(root, kind: str) -> str:
    """A transformers-5.23-saved sharded ``kind`` model with the demo tokenizer (vocab 320)."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(root / kind)
    save_tiny_hf_model(kind, d, seed=6, max_shard_size="100KB", vocab_size=320, pad_token_id=256, eos_token_id=258)
    build_demo_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """``with_tokenizer(kind)``: :func:`_with_tokenizer`'s directory, written once per module (the trainer
    runs only read it)."""
    root, made = tmp_path_factory.mktemp("v5_tok"), {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = _with_tokenizer(root, kind)
        return made[kind]

    return get


CLI_KINDS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "minimax_m2", "qwen3_next"]
# gspo-train --check, gspo-train --dry-run and tools/plan.py, each run as its command line runs it (the
# entry point with argv, its exit status and stdout/stderr) for every kind in ONE subprocess: a fresh
# interpreter per command (torch imported 18 times) cost more than the commands themselves.
# (Their own subprocess entry points: tests/train/test_cli.py, tests/config/test_plan_cli.py.)
CLI_DRIVER = """
import contextlib, io, json, os, runpy, sys
calls, report = json.loads(sys.argv[1]), sys.argv[2]
os.environ.pop("RANK", None); os.environ.pop("WORLD_SIZE", None)
out = {}
for key, argv in calls.items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:  # as `python -m gspo_megatron.train ARGS` / `python tools/plan.py ARGS` run it
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out[key] = dict(rc=rc, stdout=stdout.getvalue(), stderr=stderr.getvalue())
with open(report, "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def cli_runs(with_tokenizer, tmp_path_factory):
    """(kind, command) -> {rc, stdout, stderr}, and kind -> its output_dir."""
    root = tmp_path_factory.mktemp("cli")
    calls, out_dirs = {}, {}
    for kind in CLI_KINDS:
        hf_dir = with_tokenizer(kind)
        out_dirs[kind] = root / kind / "run"
        common = [
            "--config",
            "configs/demo_cpu.yaml",
            "model.init=pretrained",
            f"model.hf_path={hf_dir}",
            "model.arch=null",
            f"output_dir={out_dirs[kind]}",
        ]
        calls[f"{kind} check"] = ["-m", "gspo_megatron.train", *common, "--check"]
        calls[f"{kind} dry-run"] = ["-m", "gspo_megatron.train", *common, "--dry-run", "--gpus-per-node", "1"]
        calls[f"{kind} plan"] = ["tools/plan.py", *common, "--gpus-per-node", "1"]
    report = root / "report.json"
    proc = _run(["-c", CLI_DRIVER, json.dumps(calls), str(report)], timeout=600)
    assert proc.returncode == 0 and report.exists(), proc.stderr[-3000:]
    return json.loads(report.read_text()), out_dirs


@pytest.mark.parametrize("kind", CLI_KINDS)
def test_check_dry_run_and_plan_accept_a_5x_directory(cli_runs, with_tokenizer, kind):
    runs, out_dirs = cli_runs
    hf_dir = with_tokenizer(kind)
    check = runs[f"{kind} check"]
    assert check["rc"] == 0, check["stderr"][-2000:]
    assert "config OK" in check["stdout"]
    for command in ("dry-run", "plan"):
        proc = runs[f"{kind} {command}"]
        assert proc["rc"] == 0, proc["stdout"][-2000:] + proc["stderr"][-2000:]
        assert f"model    {kind} from {hf_dir}/config.json" in proc["stdout"]
        assert "experts top-" in proc["stdout"]
    assert not os.path.exists(out_dirs[kind] / "checkpoints")


def test_conversion_tools_round_trip_a_sharded_5x_checkpoint(saved_v5, tmp_path):
    """tools/hf_to_megatron.py then tools/megatron_to_hf.py on qwen2_moe as transformers 5.23 saves
    it (sharded): the same tensors back, bitwise, and the same config.json."""
    from safetensors.torch import load_file

    hf_dir, _ = saved_v5["qwen2_moe"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    for args in (
        ["tools/hf_to_megatron.py", "--hf-dir", hf_dir, "--output", ckpt],
        ["tools/megatron_to_hf.py", "--checkpoint", ckpt, "--output", out],
    ):
        proc = _run(args)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def tensors(d):
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(os.path.join(d, f)).items()}

    original, exported = tensors(hf_dir), tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert hf_config.load_hf_config(out)["num_experts"] == 4


@pytest.mark.parametrize(
    "kind,cls",
    [
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
        ("glm4_moe", "Glm4MoeForCausalLM"),
        ("gpt_oss", "GptOssForCausalLM"),
        ("minimax_m2", "MiniMaxM2ForCausalLM"),
        ("qwen3_next", "Qwen3NextForCausalLM"),
    ],
)
def test_trainer_runs_from_a_sharded_5x_directory(tmp_path, with_tokenizer, kind, cls):
    """gspo-train from a transformers-5.23-saved directory (qwen2_moe: shared expert with a gate;
    deepseek_v3: MLA, YaRN, sigmoid router with a correction bias; gpt_oss: sinks, sliding window,
    experts stacked in the checkpoint with biases): two GSPO steps, the CPU engine
    fed by the export stream (its log-probs equal the trainer's), the exported model loads in
    transformers; the correction bias (a buffer, frozen) is exported unchanged while weights moved."""
    import transformers
    from safetensors.torch import load_file

    hf_dir = with_tokenizer(kind)
    run = tmp_path / "run"
    proc = _run(
        [
            "-m",
            "gspo_megatron.train",
            "--config",
            "configs/demo_cpu.yaml",
            "model.init=pretrained",
            f"model.hf_path={hf_dir}",
            "model.arch=null",
            f"output_dir={run}",
            "train.steps=2",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "parallel.micro_batch_size=4",
            "checkpoint.interval=2",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    # step 2's rollout ran on the weights the first optimizer steps produced, synced by name
    assert rows[-1]["rollout/logprob_abs_diff"] < 1e-4
    model = transformers.AutoModelForCausalLM.from_pretrained(str(run / "hf_final"))
    assert type(model).__name__ == cls
    before = {
        k: v
        for f in os.listdir(hf_dir)
        if f.endswith(".safetensors")
        for k, v in load_file(os.path.join(hf_dir, f)).items()
    }
    after = load_file(str(run / "hf_final" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    bias = [k for k in before if k.endswith("e_score_correction_bias")]
    assert all(torch.equal(before[k], after[k]) for k in bias) and len(bias) == {
        "qwen2_moe": 0,
        "gpt_oss": 0,
        "minimax_m2": 4,
        "qwen3_next": 0,
    }.get(kind, 3)
