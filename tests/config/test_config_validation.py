"""Every validation error path names its field: static checks, world-size checks, model-layout checks."""

import json

import pytest

from gspo_megatron.config import load_config, micro_batches_per_rank, validate, validate_model_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.arch import KNOWN_ARCHS

SGLANG = ["rollout.engine=sglang", "rollout.sync_mode=colocated"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["output_dir=''"], "output_dir must be a non-empty path"),
        (["seed=-1"], "seed must be >= 0"),
        (
            ["model.arch=qwen3-30b"],
            "model.arch 'qwen3-30b' is not a built-in architecture; did you mean 'qwen3-30b-a3b'?",
        ),
        (["model.init=pretrained"], "model.init=pretrained needs model.hf_path or model.checkpoint"),
        (["model.arch=null"], "model.arch or model.hf_path must say which architecture"),
        (["model.fp8=e4m3"], "model.fp8=e4m3 needs model.dtype=bfloat16"),
        (
            ["model.fp8=e4m3", "model.dtype=bfloat16", "model.transformer_impl=local"],
            "model.fp8 needs Transformer Engine",
        ),
        (["model.moe_aux_loss_coeff=-0.1"], "model.moe_aux_loss_coeff must be >= 0"),
        (["model.max_seq_len=0"], "model.max_seq_len must be > 0"),
        (["parallel.tp=0"], "parallel.tp must be >= 1"),
        (["parallel.pp=0"], "parallel.pp must be >= 1"),
        (["parallel.ep=0"], "parallel.ep must be >= 1"),
        (["parallel.etp=0"], "parallel.etp must be >= 1"),
        (["parallel.cp=0"], "parallel.cp must be >= 1"),
        (["parallel.micro_batch_size=0"], "parallel.micro_batch_size must be >= 1"),
        (["parallel.max_tokens_per_micro_batch=-1"], "parallel.max_tokens_per_micro_batch must be >= 0"),
        (
            ["parallel.max_tokens_per_micro_batch=32", "model.max_seq_len=64"],
            "parallel.max_tokens_per_micro_batch=32 must be >= model.max_seq_len = 64",
        ),
        (
            ["parallel.max_tokens_per_micro_batch=62", "model.max_seq_len=61", "parallel.cp=4"],
            "must be >= model.max_seq_len rounded up to a multiple of 2*parallel.cp = 64",
        ),
        (["parallel.cp=2", "model.transformer_impl=local"], "parallel.cp > 1 needs Transformer Engine"),
        (["rollout.group_size=1"], "rollout.group_size must be >= 2"),
        (["rollout.prompts_per_step=0"], "rollout.prompts_per_step must be > 0"),
        (["rollout.temperature=0"], "rollout.temperature must be > 0"),
        (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
        (["rollout.top_k=0"], "rollout.top_k must be -1 (off) or >= 1"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens must be > 0"),
        (["rollout.sync_bucket_mb=0"], "rollout.sync_bucket_mb must be > 0"),
        (["rollout.engine_tp=0"], "rollout.engine_tp must be > 0"),
        (["rollout.num_engines=-1"], "rollout.num_engines must be >= 0"),
        (["rollout.engine_max_running_requests=-1"], "rollout.engine_max_running_requests must be >= 0"),
        (["rollout.engine_max_running_requests=64"], "rollout.engine_max_running_requests=64 is sglang's"),
        (["rollout.engine_mem_fraction=1.0"], "rollout.engine_mem_fraction must be in (0, 1)"),
        (["rollout.engine_timeout_s=0"], "rollout.engine_timeout_s must be > 0"),
        (["rollout.max_engine_restarts=-1"], "rollout.max_engine_restarts must be >= 0"),
        (["rollout.max_resample_rounds=-1"], "rollout.max_resample_rounds must be >= 0"),
        (["rollout.sync_mode=colocated"], "rollout.sync_mode must be inprocess with rollout.engine=hf"),
        (["rollout.sync_fp8=true"], "rollout.sync_fp8 needs rollout.engine=sglang"),
        (["rollout.num_engines=2"], "rollout.num_engines must be 0 or 1 with rollout.engine=hf"),
        (["rollout.engine=sglang"], "rollout.sync_mode must be colocated or disaggregated with rollout.engine=sglang"),
        (SGLANG + ["rollout.engine_urls=[http://a:1]"], "rollout.engine_urls needs rollout.sync_mode=disaggregated"),
        (
            [
                "rollout.engine=sglang",
                "rollout.sync_mode=disaggregated",
                "rollout.num_engines=2",
                "rollout.engine_urls=[http://a:1]",
            ],
            "rollout.num_engines=2 but rollout.engine_urls lists 1 engines",
        ),
        (["rollout.engine=sglang", "rollout.sync_mode=disaggregated"], "rollout.num_engines must be >= 1"),
        (
            [
                "rollout.engine=sglang",
                "rollout.sync_mode=disaggregated",
                "rollout.num_engines=1",
                "rollout.offload_train=true",
            ],
            "rollout.offload_train needs engines on the training devices (rollout.sync_mode colocated or inprocess)",
        ),
        (
            ["model.max_seq_len=39"],
            "model.max_seq_len=39 must be >= data.max_prompt_len + rollout.max_new_tokens = 32 + 8",
        ),
        (["gspo.clip_low=0"], "gspo.clip_low must be > 0"),
        (["gspo.clip_low=1"], "gspo.clip_low must be < 1"),
        (["gspo.clip_high=-0.1"], "gspo.clip_high must be > 0"),
        (["gspo.kl_coef=-1"], "gspo.kl_coef must be >= 0"),
        (["gspo.entropy_coef=-1"], "gspo.entropy_coef must be >= 0"),
        (["gspo.adv_eps=0"], "gspo.adv_eps must be > 0"),
        (["gspo.tis_cap=0"], "gspo.tis_cap must be > 0"),
        (["gspo.mini_batches=0"], "gspo.mini_batches must be >= 1"),
        (["gspo.loss_agg=token-mean"], "gspo.loss_agg=token-mean is not allowed with gspo.mode=gspo"),
        # token-sum is refused (it used to be accepted and silently trained as seq-mean-token-mean)
        (
            ["gspo.mode=grpo", "gspo.loss_agg=token-sum"],
            "gspo.loss_agg must be one of 'seq-mean-token-mean', 'token-mean'",
        ),
        (["reward.max_failure_share=0"], "reward.max_failure_share must be in (0, 1]"),
        (["reward.max_failure_share=1.5"], "reward.max_failure_share must be in (0, 1]"),
        (
            ["gspo.mode=gspo_token", "gspo.loss_agg=token-mean"],
            "gspo.loss_agg=token-mean is not allowed with gspo.mode=gspo_token",
        ),
        (["optimizer.lr=0"], "optimizer.lr must be > 0"),
        (["optimizer.min_lr=1"], "optimizer.min_lr must be in [0, optimizer.lr=0.001]"),
        (["optimizer.weight_decay=-1"], "optimizer.weight_decay must be >= 0"),
        (["optimizer.adam_beta1=1"], "optimizer.adam_beta1 must be in [0, 1)"),
        (["optimizer.adam_beta2=-0.1"], "optimizer.adam_beta2 must be in [0, 1)"),
        (["optimizer.adam_eps=0"], "optimizer.adam_eps must be > 0"),
        (["optimizer.clip_grad=-1"], "optimizer.clip_grad must be >= 0"),
        (["optimizer.lr_warmup_steps=-1"], "optimizer.lr_warmup_steps must be >= 0"),
        (["optimizer.cpu_offload_fraction=2"], "optimizer.cpu_offload_fraction must be in [0, 1]"),
        (
            ["optimizer.cpu_offload_fraction=0.5", "parallel.use_distributed_optimizer=false"],
            "optimizer.cpu_offload_fraction > 0 needs parallel.use_distributed_optimizer=true",
        ),
        (["optimizer.max_bad_steps=0"], "optimizer.max_bad_steps must be >= 1"),
        (["train.steps=0"], "train.steps must be > 0"),
        (["train.log_interval=0"], "train.log_interval must be > 0"),
        (["data.task=null"], "data.path or data.task must be set"),
        (["data.task=last_digits"], "data.task 'last_digits' is not a built-in task"),
        (["data.path=prompts.csv"], "data.path must end in .jsonl or .parquet"),
        (["data.prompt_key=''"], "data.prompt_key must be non-empty"),
        (["data.label_key=''"], "data.label_key must be non-empty"),
        (["data.max_prompt_len=0"], "data.max_prompt_len must be > 0"),
        (["reward.function=maths"], "reward.function 'maths' is not built in"),
        (["reward.function=rewards/score.txt:score"], "must be 'path/to/file.py:function_name' or 'package.module:"),
        (["reward.function=score.py:1x"], "must be 'path/to/file.py:function_name'"),
        (["rollout.custom_function=hooks/turn.txt:run"], "rollout.custom_function 'hooks/turn.txt:run' must be"),
        (["reward.timeout_s=0"], "reward.timeout_s must be > 0"),
        (["reward.num_workers=-1"], "reward.num_workers must be >= 0"),
        (["checkpoint.interval=-1"], "checkpoint.interval must be >= 0"),
        (["checkpoint.keep_last=-1"], "checkpoint.keep_last must be >= 0"),
        (["logging.wandb_project=''"], "logging.wandb_project must be non-empty or null"),
        (
            ["rollout.prompts_per_step=3", "rollout.group_size=3"],
            "rollout.prompts_per_step * rollout.group_size = 3 * 3 = 9 sequences per step must be divisible by "
            "gspo.mini_batches * data-parallel size * parallel.micro_batch_size = 2 * 1 * 4 = 8",
        ),
    ],
)
def test_static_errors_name_the_field(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["gspo.mode=grpo", "gspo.loss_agg=token-mean"],
        ["reward.function=exact_match"],
        ["reward.function=math"],
        ["reward.function=add_digits"],
        ["rollout.engine=sglang", "rollout.sync_mode=disaggregated", "rollout.engine_urls=[http://a:1, http://b:1]"],
        ["model.fp8=hybrid", "model.dtype=bfloat16"],
    ],
)
def test_valid_combinations_load(overrides):
    load_config(None, overrides)


def test_files_that_must_exist(tmp_path):
    model = tmp_path / "model"
    cases = {
        "model.hf_path": [f"model.hf_path={tmp_path / 'nope'}"],
        "model.checkpoint": [f"model.checkpoint={tmp_path / 'ckpt'}"],
        "data.path": [f"data.path={tmp_path / 'p.jsonl'}"],
        "reward.function": [f"reward.function={tmp_path / 'r.py'}:score"],
        "checkpoint.load": [f"checkpoint.load={tmp_path / 'ckpt'}"],
    }
    for name, ov in cases.items():
        with pytest.raises(ConfigError, match=f"{name}: .* does not exist"):
            load_config(None, ov)
        load_config(None, ov, check_files=False)
    model.mkdir()
    with pytest.raises(ConfigError, match="model.hf_path: no config.json"):
        load_config(None, [f"model.hf_path={model}"])
    (model / "config.json").write_text(json.dumps(KNOWN_ARCHS["tiny-qwen3-moe"]))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "label": "b"}\n')
    (tmp_path / "r.py").write_text("def score(prompt, response, label):\n    return 1.0\n")
    cfg = load_config(
        None,
        [
            f"model.hf_path={model}",
            "model.init=pretrained",
            f"data.path={tmp_path / 'p.jsonl'}",
            f"reward.function={tmp_path / 'r.py'}:score",
        ],
    )
    assert cfg.model.hf_path == str(model)


def test_a_path_of_the_wrong_kind_says_so(tmp_path):
    (tmp_path / "p.jsonl").mkdir()
    with pytest.raises(ConfigError, match=r"data.path: '.*p.jsonl' is a directory, expected a file"):
        load_config(None, [f"data.path={tmp_path / 'p.jsonl'}"])
    (tmp_path / "model").write_text("x")
    with pytest.raises(ConfigError, match=r"model.hf_path: '.*model' is a file, expected a dir"):
        load_config(None, [f"model.hf_path={tmp_path / 'model'}"])


def test_reward_and_hook_by_module_name(tmp_path, monkeypatch):
    """'package.module:function' is imported as Python imports it (the start-up checks call it once)."""
    from gspo_megatron.data.dataset import PromptRow
    from gspo_megatron.errors import UserInputError
    from gspo_megatron.preflight import check_reward

    pkg = tmp_path / "myrl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def score(prompt, response, label):\n    return float(response == label)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["reward.function=myrl.scoring:score", "rollout.custom_function=myrl.turns:run"])
    assert cfg.reward.function == "myrl.scoring:score"
    row = PromptRow(prompt="q", text="q", prompt_ids=[1], label="2", source="data.jsonl line 1")
    check_reward("myrl.scoring:score", row)
    with pytest.raises(UserInputError, match=r"reward.function 'myrl.nope:score': ModuleNotFoundError: .*myrl.nope"):
        check_reward("myrl.nope:score", row)


def moe(**kw):
    return load_config(
        None,
        ["rollout.prompts_per_step=16", "rollout.group_size=4", "gspo.mini_batches=2", "parallel.micro_batch_size=1"]
        + [f"{k.replace('__', '.')}={v}" for k, v in kw.items()],
    )


def test_world_size_checks():
    validate(moe(), None)
    validate(moe(parallel__tp=2, parallel__pp=2), 8)
    with pytest.raises(
        ConfigError, match=r"parallel.tp \* parallel.pp \* parallel.cp = 2 \* 2 \* 1 = 4 must divide the world size 6"
    ):
        validate(moe(parallel__tp=2, parallel__pp=2), 6)
    with pytest.raises(
        ConfigError, match=r"parallel.ep \* parallel.etp \* parallel.pp = 4 \* 1 \* 1 = 4 must divide the world size 2"
    ):
        validate(moe(parallel__ep=4), 2)
    with pytest.raises(ConfigError, match="world size must be >= 1"):
        validate(moe(), 0)
    # 64 sequences / (2 mini-batches * DP 8 * micro-batch 4) = 1 micro-batch per rank; DP 16 cannot split it
    cfg = moe(parallel__micro_batch_size=4)
    validate(cfg, 8)
    assert micro_batches_per_rank(cfg, 8) == 1 and micro_batches_per_rank(moe(), 2) == 16
    with pytest.raises(
        ConfigError,
        match="= 2 \\* 16 \\* 4 = 128 \\(each mini-batch is split evenly over the "
        "data-parallel ranks, and each rank's share into whole micro-batches\\)",
    ):
        validate(cfg, 16)


def test_colocated_engine_checks():
    cfg = moe(rollout__engine="sglang", rollout__sync_mode="colocated", rollout__engine_tp=4)
    # 8 ranks, two engines of TP4: engine e is fed by training ranks 4e..4e+3 (weight_sync.topology's
    # colocated routing), the shape tests/topology/test_multinode.py runs (two engines of TP2, 4 ranks)
    validate(cfg, 8)
    with pytest.raises(ConfigError, match="rollout.engine_tp=4 must divide the number of training GPUs 6"):
        validate(
            moe(rollout__engine="sglang", rollout__sync_mode="colocated", rollout__engine_tp=4, gspo__mini_batches=1), 6
        )
    bad = moe(rollout__engine="sglang", rollout__sync_mode="colocated", rollout__engine_tp=4, rollout__num_engines=1)
    with pytest.raises(ConfigError, match=r"rollout.num_engines \* rollout.engine_tp = 1 \* 4 must equal"):
        validate(bad, 8)


QWEN = KNOWN_ARCHS["qwen3-30b-a3b"]  # 32 heads, 4 kv heads, 128 experts, 48 layers, moe ffn 768


@pytest.mark.parametrize(
    "kw, hf, expected",
    [
        (dict(parallel__tp=3), QWEN, "parallel.tp=3 must divide num_attention_heads = 32"),
        (
            dict(parallel__tp=8),
            QWEN,
            "parallel.tp=8 must divide num_key_value_heads = 4 (Megatron needs num_query_groups % tp == 0)",
        ),
        (dict(parallel__tp=2), {**QWEN, "vocab_size": 151937}, "parallel.tp=2 must divide vocab_size = 151937"),
        (
            dict(parallel__tp=2),
            {**QWEN, "mlp_only_layers": [0], "intermediate_size": 6145},
            "parallel.tp=2 must divide intermediate_size = 6145",
        ),
        (dict(parallel__ep=3), QWEN, "parallel.ep=3 must divide the number of experts = 128"),
        (dict(parallel__etp=5, parallel__tp=1), QWEN, "parallel.etp=5 must divide moe_intermediate_size = 768"),
        (dict(parallel__pp=5), QWEN, "parallel.pp=5 must divide num_hidden_layers = 48"),
        (
            dict(parallel__tp=2, parallel__sequence_parallel="false"),
            QWEN,
            "parallel.sequence_parallel must be true for an MoE model with parallel.tp > 1",
        ),
        (
            dict(parallel__ep=2),
            {**QWEN, "model_type": "qwen3", "intermediate_size": 6144},
            "parallel.ep=2 needs an MoE model",
        ),
        (
            dict(model__max_seq_len=50000),
            QWEN,
            "model.max_seq_len=50000 exceeds the model's max_position_embeddings = 40960",
        ),
        (
            dict(rollout__engine="sglang", rollout__sync_mode="colocated", rollout__engine_tp=3),
            QWEN,
            "rollout.engine_tp=3 must divide num_attention_heads = 32",
        ),
    ],
)
def test_model_layout_errors_name_the_field(kw, hf, expected):
    with pytest.raises(ConfigError) as e:
        validate_model_layout(moe(**kw), hf)
    assert expected in str(e.value), str(e.value)


def test_model_layout_accepts_the_recipe_layouts():
    validate_model_layout(moe(parallel__tp=4, parallel__ep=16, parallel__etp=1, parallel__pp=2), QWEN)
    # a RoPE scaling the model families cannot run yet is refused before any model is built
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        validate_model_layout(moe(model__max_seq_len=50000), {**QWEN, "rope_scaling": {"type": "llama3", "factor": 4}})
    # YaRN (a long-context checkpoint) is accepted, and lifts the max_position_embeddings bound
    validate_model_layout(
        moe(model__max_seq_len=50000),
        {**QWEN, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}},
    )
