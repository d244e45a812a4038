"""Loading, overrides, unknown keys, resolution, save/load round trip and help text of the config."""

import dataclasses
import typing

import pytest
import yaml

from gspo_megatron.config import Config, config_help, load_config, save_config
from gspo_megatron.errors import ConfigError


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def all_fields(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from all_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_defaults_are_a_valid_cpu_demo():
    cfg = load_config(None, [])
    assert cfg.output_dir == "runs/demo" and cfg.seed == 1234
    assert cfg.rollout.engine == "hf" and cfg.rollout.sync_mode == "inprocess"
    assert cfg.model.arch == "tiny-qwen3-moe" and cfg.model.init == "random"


def test_yaml_values_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, {"seed": 7, "rollout": {"group_size": 4, "stop": ["</s>"]}, "optimizer": {"lr": 0.01}})
    cfg = load_config(
        path,
        [
            "optimizer.lr=1e-6",
            "rollout.temperature=0.7",
            "model.recompute=true",
            "rollout.stop=[a, b]",
            "gspo.tis_cap=2",
            "logging.wandb_project=null",
            "output_dir=123",
            "parallel.etp=~",
        ],
    )
    assert cfg.seed == 7 and cfg.rollout.group_size == 4
    assert cfg.optimizer.lr == 1e-6 and isinstance(cfg.optimizer.lr, float)  # YAML reads 1e-6 as a string
    assert cfg.rollout.temperature == 0.7 and cfg.model.recompute is True
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.gspo.tis_cap == 2.0 and isinstance(cfg.gspo.tis_cap, float)
    assert cfg.logging.wandb_project is None and cfg.output_dir == "123"


def test_later_override_wins_and_single_string_becomes_list():
    cfg = load_config(None, ["seed=1", "seed=2", "rollout.stop=</s>"])
    assert cfg.seed == 2 and cfg.rollout.stop == ["</s>"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.hf_pth=/x", "unknown key 'model.hf_pth'; did you mean 'model.hf_path'?"),
        ("rollout.grup_size=4", "did you mean 'rollout.group_size'?"),
        ("modle.dtype=float32", "unknown key 'modle'; did you mean 'model'?"),
        ("gspo.zzzzzz=1", "unknown key 'gspo.zzzzzz'; allowed keys: mode, clip_low"),
    ],
)
def test_unknown_keys_are_rejected_with_did_you_mean(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_unknown_key_in_file_is_rejected(tmp_path):
    path = write(tmp_path, {"parallel": {"tensor_parallel": 2}})
    with pytest.raises(ConfigError, match="unknown key 'parallel.tensor_parallel'"):
        load_config(path, [])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("seed=abc", "seed must be int, got 'abc'"),
        ("model.recompute=1", "model.recompute must be bool, got 1"),
        ("parallel.tp=2.5", "parallel.tp must be int, got 2.5"),
        ("optimizer.lr=fast", "optimizer.lr must be float, got 'fast'"),
        ("model.dtype=bf16", "model.dtype must be one of 'float32', 'bfloat16', 'float16'; got 'bf16'"),
        ("gspo.mode=gsop", "did you mean 'gspo'?"),
        ("rollout.stop=3", "rollout.stop must be list[str], got 3"),
        ("rollout.stop=[a, true]", "rollout.stop[1] must be str, got True"),
        ("model.max_seq_len=null", "model.max_seq_len must be int, got None"),
        ("model=3", "model must be a mapping of its keys"),
        ("rollout.stop=[a", "value is not valid YAML"),
        ("no_equals_sign", "must look like section.key=value"),
        ("model..dtype=x", "empty key"),
    ],
)
def test_type_errors_name_the_field(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_all_errors_are_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["seed=x", "model.dtype=y", "rollout.group_size=1"])
    assert len(e.value.errors) == 2  # type errors stop before the value checks
    assert "2 config errors" in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"), [])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,\n"), [])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"), [])
    assert load_config(write(tmp_path, ""), []) == load_config(None, [])


@pytest.mark.parametrize("mode, low, high", [("gspo", 3e-4, 4e-4), ("gspo_token", 3e-4, 4e-4), ("grpo", 0.2, 0.2)])
def test_clip_defaults_follow_the_mode(mode, low, high):
    extra = ["gspo.loss_agg=token-mean"] if mode == "grpo" else []
    cfg = load_config(None, [f"gspo.mode={mode}"] + extra)
    assert (cfg.gspo.clip_low, cfg.gspo.clip_high) == (low, high)
    cfg = load_config(None, [f"gspo.mode={mode}", "gspo.clip_low=0.1", "gspo.clip_high=0.3"] + extra)
    assert (cfg.gspo.clip_low, cfg.gspo.clip_high) == (0.1, 0.3)


def test_parallel_auto_values():
    cfg = load_config(None, ["parallel.tp=2", "parallel.micro_batch_size=1"])
    assert cfg.parallel.etp == 2 and cfg.parallel.sequence_parallel is True
    cfg = load_config(None, ["parallel.tp=2", "parallel.etp=1", "parallel.sequence_parallel=false"])
    assert cfg.parallel.etp == 1 and cfg.parallel.sequence_parallel is False
    cfg = load_config(None, ["parallel.sequence_parallel=true"])  # no TP: Megatron disables SP
    assert cfg.parallel.sequence_parallel is False


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["rollout.stop=[x]", "optimizer.lr=2e-5", "parallel.tp=2"])
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, str(out))
    again = load_config(str(out), [])
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert yaml.safe_load(out.read_text())["parallel"]["etp"] == 2  # resolved values are saved


def test_recipes_load_without_their_placeholder_files():
    import glob

    # the GPU recipes (the *_cpu configs and the tiny topology configs run on CPU as they are)
    paths = [p for p in glob.glob("configs/*.yaml") if not p.endswith(("_cpu.yaml", "_tiny.yaml"))]
    assert {"configs/qwen3_30b_a3b_gspo.yaml", "configs/qwen3_235b_a22b_gspo.yaml"} <= set(paths)
    for p in paths:
        cfg = load_config(p, [], check_files=False)
        assert cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "sglang"
        with pytest.raises(ConfigError, match="model.hf_path: dir '/path/to"):
            load_config(p, [])  # with file checks the placeholders are reported


def test_gspo_recipes_use_the_paper_settings():
    for p in ("configs/qwen3_30b_a3b_gspo.yaml", "configs/qwen3_235b_a22b_gspo.yaml"):
        g = load_config(p, [], check_files=False).gspo
        assert (g.mode, g.clip_low, g.clip_high, g.loss_agg) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
        assert g.mini_batches > 1
        assert load_config(p, [], check_files=False).optimizer.lr == 1e-6


def test_help_documents_every_field_with_type_default_and_description():
    text = config_help()
    for name, f in all_fields():
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"{name}:")), None)
        assert line is not None, name
        assert "=" in line
        assert f.metadata.get("help"), f"{name} has no description"
        assert f.metadata["help"] in text
    assert "model.dtype: 'float32'|'bfloat16'|'float16' = float32" in text
    assert "gspo.clip_low: float | null = null" in text


def test_tiny_topology_configs_keep_the_recipes_keys():
    """configs/topology_*_tiny.yaml: the recipes' rollout / parallel keys at tiny scale (run by
    tests/topology/test_multinode.py), loadable as they are."""
    import yaml

    for tiny, recipe in (
        ("configs/topology_30b_tiny.yaml", "configs/qwen3_30b_a3b_gspo.yaml"),
        ("configs/topology_235b_tiny.yaml", "configs/qwen3_235b_a22b_gspo.yaml"),
    ):
        t, r = (yaml.safe_load(open(p)) for p in (tiny, recipe))
        cfg = load_config(tiny, [])
        assert cfg.rollout.engine == "sglang" and cfg.rollout.engine_server == "cpu"
        assert cfg.rollout.sync_mode == r["rollout"]["sync_mode"] == "colocated"
        assert cfg.rollout.offload_train == r["rollout"]["offload_train"]
        for key in ("tp", "pp", "ep", "etp"):
            assert key in t["parallel"] and key in r["parallel"]


def test_component_options_are_read_from_the_config_by_name():
    """OptimOptions, PolicyLossConfig and ModelOptions get every field from the config by name
    (config.values_for, as train.py, trainer/step.py and factory.py call it): a changed config value
    reaches them, and a field that no section has is refused naming it."""
    import dataclasses

    import pytest

    from gspo_megatron.config import values_for
    from gspo_megatron.losses.policy_loss import PolicyLossConfig
    from gspo_megatron.models.build import ModelOptions
    from gspo_megatron.trainer.optimizer import OptimOptions
    from gspo_megatron.trainer.step import loss_config

    cfg = load_config(
        None,
        [
            "optimizer.lr=0.25",
            "optimizer.adam_beta2=0.5",
            "parallel.grad_reduce_in_fp32=false",
            "gspo.mode=grpo",
            "gspo.loss_agg=token-mean",
            "gspo.tis_cap=2.0",
            "model.recompute=true",
            "model.moe_aux_loss_coeff=0.01",
        ],
    )
    o = OptimOptions(**values_for(OptimOptions, cfg.optimizer, cfg.parallel, total_steps=6))
    assert (o.lr, o.adam_beta2, o.grad_reduce_in_fp32, o.total_steps) == (0.25, 0.5, False, 6)
    for f in dataclasses.fields(o):
        section = cfg.optimizer if hasattr(cfg.optimizer, f.name) else cfg.parallel
        assert f.name == "total_steps" or getattr(o, f.name) == getattr(section, f.name), f.name
    lc = loss_config(cfg)
    assert isinstance(lc, PolicyLossConfig)
    assert (lc.mode, lc.aggregation, lc.tis_cap, lc.clip_low) == ("grpo", "token-mean", 2.0, 0.2)
    m = ModelOptions(**values_for(ModelOptions, cfg.model, cfg.parallel, fp8_fields=None, perform_initialization=True))
    assert (m.recompute, m.moe_aux_loss_coeff, m.dtype) == (True, 0.01, cfg.model.dtype)

    @dataclasses.dataclass
    class Renamed:
        learning_rate: float = 0.0

    with pytest.raises(TypeError, match="Renamed.learning_rate: no config key 'learning_rate' in OptimizerConfig"):
        values_for(Renamed, cfg.optimizer)
