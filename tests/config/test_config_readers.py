"""Every config field is read by the code it configures (issue 14: a key nobody reads is a defect).

READERS names, for every field, the module that reads it. The test fails when a field is added
without an entry here, when an entry names a field that no longer exists, and when the named module
does not read it: the module must contain ``cfg.<section>.<field>`` or ``<alias>.<field>`` where
``<alias> = cfg.<section>`` is assigned in that module (``cfg.<field>`` for top-level fields)."""

import dataclasses
import os
import re

import pytest

from gspo_megatron.config import Config

PKG = os.path.join(os.path.dirname(__file__), "..", "..", "gspo_megatron")

READERS = {
    "output_dir": "train.py",
    "seed": "train.py",
    "model.arch": "models/arch.py",  # model_hf_config: the built-in table when hf_path has no config.json
    "model.hf_path": "factory.py",
    "model.checkpoint": "train.py",
    "model.init": "factory.py",
    "model.dtype": "factory.py",
    "model.fp8": "factory.py",
    "model.fp8_recipe": "factory.py",
    "model.transformer_impl": "factory.py",
    "model.moe_token_dispatcher": "factory.py",
    "model.moe_aux_loss_coeff": "factory.py",
    "model.lora.rank": "factory.py",  # LoraOptions -> models/lora.py (validation.py checks them)
    "model.lora.alpha": "factory.py",
    "model.lora.dropout": "factory.py",
    "model.lora.target_modules": "factory.py",
    "model.recompute": "factory.py",
    "model.fused_logprobs": "trainer/step.py",
    "model.max_seq_len": "planner.py",  # activation and KV-cache sizes (and the config's own checks)
    "parallel.tp": "train.py",
    "parallel.pp": "train.py",
    "parallel.ep": "train.py",
    "parallel.etp": "train.py",
    "parallel.cp": "train.py",
    "parallel.sequence_parallel": "train.py",
    "parallel.micro_batch_size": "trainer/step.py",
    "parallel.max_tokens_per_micro_batch": "trainer/step.py",
    "parallel.use_distributed_optimizer": "train.py",
    "parallel.grad_reduce_in_fp32": "train.py",
    "rollout.engine": "factory.py",
    "rollout.engine_server": "fleet/engine_fleet.py",
    "rollout.group_size": "orchestration/batch.py",
    "rollout.prompts_per_step": "orchestration/batch.py",
    "rollout.temperature": "orchestration/batch.py",
    "rollout.top_p": "orchestration/batch.py",
    "rollout.top_k": "orchestration/batch.py",
    "rollout.max_new_tokens": "orchestration/batch.py",
    "rollout.stop": "orchestration/batch.py",
    "rollout.sync_mode": "orchestration/build.py",
    "rollout.sync_bucket_mb": "orchestration/build.py",
    "rollout.sync_verify": "orchestration/build.py",
    "rollout.sync_fp8": "weight_sync/topology.py",
    "rollout.sync_delta": "weight_sync/topology.py",
    "rollout.sync_delta_dir": "weight_sync/topology.py",
    "rollout.sync_owner_direct": "weight_sync/topology.py",
    "rollout.sync_verify_tol": "orchestration/build.py",
    "rollout.sync_verify_every": "orchestration/build.py",
    "rollout.offload_train": "features/offload.py",  # the component; trainer/offload.py does the moving
    "rollout.engine_tp": "fleet/engine_fleet.py",
    "rollout.engine_ep": "engines/engine_model.py",
    "rollout.num_engines": "planner.py",
    "rollout.engine_mem_fraction": "fleet/engine_fleet.py",
    "rollout.engine_max_running_requests": "features/speculative.py",  # max_running_requests -> fleet/engine_args.py
    "rollout.engine_urls": "fleet/engine_fleet.py",
    "rollout.router_url": "fleet/engine_fleet.py",
    "rollout.engine_launch_timeout_s": "fleet/engine_fleet.py",
    "rollout.engine_deterministic": "fleet/engine_fleet.py",
    "rollout.engine_timeout_s": "factory.py",
    "rollout.max_engine_restarts": "orchestration/build.py",
    "rollout.engine_process": "factory.py",
    "rollout.dynamic_sampling": "orchestration/batch.py",
    "rollout.max_resample_rounds": "orchestration/batch.py",
    "rollout.over_sample": "orchestration/batch.py",
    "rollout.custom_function": "orchestration/batch.py",
    "rollout.routing_replay": "trainer/step.py",  # and factory.py (r3: the engines return routes)
    "rollout.lora_sync": "features/adapter_sync.py",  # merged: the export stream merges (models/lora.py); adapter: weight_sync/lora_adapter.py
    "rollout.lora_adapter_dir": "orchestration/build.py",  # lora_sync=adapter, engines not colocated: the PEFT directories (weight_sync/lora_adapter.py)
    "rollout.max_staleness": "orchestration/async_producer.py",
    "rollout.inflight_updates": "orchestration/inflight.py",  # and fleet/engine_fleet.py (the clients' pause mode)
    "rollout.inflight_groups": "features/inflight.py",
    "rollout.speculative": "features/speculative.py",  # the engines' flags and refusals
    "rollout.speculative_steps": "features/speculative.py",
    "model.mtp": "features/speculative.py",  # its refusals; Config.mtp_in_model resolves null
    "gspo.mtp_loss_coef": "trainer/step.py",
    "gspo.mode": "trainer/step.py",
    "gspo.clip_low": "trainer/step.py",
    "gspo.clip_high": "trainer/step.py",
    "gspo.kl_coef": "trainer/step.py",
    "gspo.kl_estimator": "trainer/step.py",
    "gspo.entropy_coef": "trainer/step.py",
    "gspo.std_normalize": "orchestration/batch.py",
    "gspo.adv_eps": "orchestration/batch.py",
    "gspo.tis_cap": "trainer/step.py",
    "gspo.tis_level": "trainer/step.py",
    "gspo.tis_mode": "trainer/step.py",
    "gspo.mini_batches": "trainer/step.py",
    "gspo.loss_agg": "trainer/step.py",
    "distill.coef": "trainer/step.py",  # PolicyLossConfig.distill_coef
    "distill.reward_coef": "trainer/step.py",
    "distill.loss": "trainer/step.py",
    "distill.teachers": "distill/__init__.py",
    "distill.teacher_key": "factory.py",  # each row's teacher (data.dataset)
    "distill.engines_per_teacher": "distill/teacher_servers.py",
    "distill.teacher_tp": "distill/teacher_servers.py",
    "distill.teacher_mem_fraction": "distill/teacher_servers.py",
    "distill.batch_size": "distill/teachers.py",
    "distill.timeout_s": "distill/teachers.py",
    "distill.topk": "distill/teachers.py",
    "optimizer.lr": "train.py",
    "optimizer.min_lr": "train.py",
    "optimizer.weight_decay": "train.py",
    "optimizer.adam_beta1": "train.py",
    "optimizer.adam_beta2": "train.py",
    "optimizer.adam_eps": "train.py",
    "optimizer.clip_grad": "train.py",
    "optimizer.lr_warmup_steps": "train.py",
    "optimizer.lr_decay_style": "train.py",
    "optimizer.cpu_offload_fraction": "train.py",
    "optimizer.max_bad_steps": "train.py",
    "optimizer.mtp_lr": "train.py",
    "train.steps": "train.py",
    "train.log_interval": "train.py",
    "data.path": "factory.py",
    "data.task": "factory.py",
    "data.prompt_key": "factory.py",
    "data.label_key": "factory.py",
    "data.apply_chat_template": "factory.py",
    "data.max_prompt_len": "factory.py",
    "data.skip_bad_rows": "factory.py",
    "data.shuffle": "train.py",
    "reward.function": "factory.py",
    "reward.timeout_s": "factory.py",
    "reward.num_workers": "factory.py",
    "reward.max_failure_share": "factory.py",
    "reward.group": "factory.py",
    "reward.url": "factory.py",
    "reward.batch_size": "factory.py",
    "reward.max_in_flight": "factory.py",
    "reward.retries": "factory.py",
    "eval.interval": "evaluation.py",
    "eval.datasets": "evaluation.py",
    "eval.n": "evaluation.py",
    "eval.greedy": "evaluation.py",
    "eval.temperature": "evaluation.py",
    "eval.pass_k": "evaluation.py",
    "eval.pass_threshold": "evaluation.py",
    "eval.max_prompts": "evaluation.py",
    "checkpoint.interval": "train.py",
    "checkpoint.keep_last": "train.py",
    "checkpoint.save_on_signal": "train.py",
    "checkpoint.load": "train.py",
    "logging.tensorboard": "train.py",
    "logging.wandb_project": "train.py",
    "logging.progress": "train.py",
}
# Read once the integrator merges the branches that wire them; remove from here then (strict xfail
# turns into a failure as soon as they are read, so this list cannot go stale).
PENDING: set[str] = set()


def all_fields(cls=Config, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from all_fields(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def reads(source: str, name: str) -> bool:
    *section, leaf = name.split(".")
    if not section:
        return re.search(rf"\bcfg\.{leaf}\b(?!\s*=[^=])", source) is not None
    sec = ".".join(section)  # a nested section (model.lora): its full path
    aliases = ["cfg." + sec] + re.findall(rf"^\s*(\w+)\s*=\s*cfg\.{re.escape(sec)}\s*$", source, re.M)
    return any(re.search(rf"(?<![\w.]){re.escape(a)}\.{leaf}\b(?!\s*=[^=])", source) for a in aliases) or read_by_name(
        source, sec, leaf, aliases
    )


def _options_classes() -> dict[str, type]:
    from gspo_megatron.losses.policy_loss import PolicyLossConfig
    from gspo_megatron.models.build import ModelOptions
    from gspo_megatron.trainer.optimizer import OptimOptions

    return {c.__name__: c for c in (OptimOptions, PolicyLossConfig, ModelOptions)}


def read_by_name(source: str, sec: str, leaf: str, aliases: list[str]) -> bool:
    """``values_for(Options, ..., cfg.<sec>, ...)`` reads every field of ``cfg.<sec>`` that the options
    dataclass has under the same name, or under a ``renamed={...: "<leaf>"}`` entry."""
    for m in re.finditer(r"values_for\(\s*(\w+)\s*,(.*?)\)\)?\s*$", source, re.M | re.S):
        cls = _options_classes().get(m.group(1))
        args = m.group(2)
        if cls is None or not any(re.search(rf"(?<![\w.]){re.escape(a)}(?![\w.])", args) for a in aliases):
            continue
        names = {f.name for f in dataclasses.fields(cls)}
        given = set(re.findall(r"(\w+)\s*=", args))
        named = re.search(r"renamed=(\w+)", args)  # renamed=<a dict assigned in the module>
        if named:
            assigned = re.search(rf"^\s*{named.group(1)}\s*=\s*(\{{.*?\}})", source, re.M | re.S)
            args += assigned.group(1) if assigned else ""
        renamed = dict(re.findall(r"[\"'](\w+)[\"']\s*:\s*[\"'](\w+)[\"']", args))
        if (leaf in names and leaf not in given and leaf not in renamed) or leaf in renamed.values():
            return True
    return False


def test_the_table_lists_every_field_and_nothing_else():
    fields = list(all_fields())
    assert sorted(fields) == sorted(READERS), (
        f"fields without a reader entry: {sorted(set(fields) - set(READERS))}; "
        f"entries for fields that do not exist: {sorted(set(READERS) - set(fields))}"
    )


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="wired by another branch")) if n in PENDING else n
        for n in sorted(READERS)
    ],
)
def test_each_field_is_read_by_its_module(name):
    path = os.path.join(PKG, READERS[name])
    assert reads(open(path).read(), name), f"{name} is not read in gspo_megatron/{READERS[name]}"


def test_the_reader_check_can_fail():
    assert reads("x = cfg.train.steps + 1", "train.steps")
    assert reads("o = cfg.optimizer\nlr = o.lr", "optimizer.lr")
    assert not reads("cfg.train.steps = 3", "train.steps")  # a write is not a read
    assert not reads("positive('train.log_interval', cfg.train.steps)", "train.log_interval")
    assert not reads("o = cfg.optimizer\nlr = p.lr", "optimizer.lr")
    assert reads("o = OptimOptions(**values_for(OptimOptions, cfg.optimizer, cfg.parallel))", "optimizer.lr")
    assert reads('x = values_for(PolicyLossConfig, cfg.gspo, renamed={"aggregation": "loss_agg"})', "gspo.loss_agg")
    assert not reads("o = OptimOptions(**values_for(OptimOptions, cfg.parallel))", "optimizer.lr")
    assert not reads("x = values_for(PolicyLossConfig, cfg.gspo)", "gspo.std_normalize")  # not a loss field
