"""Rank functions of tests/train/test_mtp_step.py (module level: spawned ranks import them).

``step_grads`` runs the trainer's own step pieces (``trainer.step.split_batch``, the old-log-prob pass of
``trainer.step_passes.CurrentPolicy`` with the draft's acceptance, one forward-backward through
``trainer.micro_batches.run_schedule`` with ``losses.megatron_loss.make_megatron_loss_func``) on the same
records for a model built without MTP layers and one built with them (``ModelOptions.mtp``), and returns
per model the old log-probs, every parameter's gradient by name, the loss metrics and the acceptance
counts."""

from __future__ import annotations


def make_records(vocab: int, seed: int = 0) -> list:
    """Mixed-length Samples (prompt 2-6 tokens, response 3-9) with advantages of both signs."""
    import torch

    from gspo_megatron.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(8):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(3, 10, (1,), generator=g))
        ids = torch.randint(1, vocab, (p + r,), generator=g).tolist()
        out.append(
            Sample(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                engine_logprobs=[-1.0] * r,
                advantage=float(i % 3) - 1.0,
            )
        )
    return out


def _config(budget: int):
    """The batch settings (the model is built here, not from the config; the MTP coefficient goes to the
    loss function directly)."""
    from gspo_megatron.config import load_config

    return load_config(
        None,
        [
            "parallel.micro_batch_size=2",
            f"parallel.max_tokens_per_micro_batch={budget}",
            "gspo.mini_batches=1",
            "model.max_seq_len=16",
            "data.max_prompt_len=8",
            "rollout.max_new_tokens=8",
        ],
    )


def _loss_func(cfg, dp: int, num_microbatches: int, coef: float):
    """The trainer's loss-function factory for ``run_schedule`` with the MTP loss at ``coef``."""
    from functools import partial

    from megatron.core import parallel_state as ps

    from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
    from gspo_megatron.trainer.step import loss_config

    return partial(
        make_megatron_loss_func,
        cfg=loss_config(cfg),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=None,
        data_parallel_size=dp,
        num_microbatches=num_microbatches,
        check_finite=False,
        mtp_coef=coef,
    )


def _one_model(hf_dir: str, layout: dict, mtp: bool, records: list, budget: int, coef: float) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.runtime.distributed import destroy_distributed
    from gspo_megatron.trainer.micro_batches import run_schedule, sequence_multiple
    from gspo_megatron.trainer.optimizer import zero_grads
    from gspo_megatron.trainer.step import split_batch
    from gspo_megatron.trainer.step_passes import CurrentPolicy
    from tiny_models import tiny_megatron_model

    parallel = {k: v for k, v in layout.items() if k != "recompute"}
    ddp, opt, _sched = tiny_megatron_model(hf_dir, parallel, mtp=mtp, recompute=bool(layout.get("recompute")))
    cfg = _config(budget)
    dp, tp = ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    (micro,) = split_batch(cfg, records, dp, ps.get_data_parallel_rank(), pad_id=0, multiple=sequence_multiple(tp, 1))
    CurrentPolicy(1.0, True, drafts=mtp).attach_old(ddp, micro, records)
    zero_grads(ddp, opt)
    out = run_schedule(
        ddp, micro, _loss_func(cfg, dp, len(micro), coef), forward_only=False, with_drafts=mtp and coef > 0
    )
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
    result = {
        "last": ps.is_pipeline_last_stage(),
        "old": [b["old_logprobs"].clone() for b in micro],
        "grads": grads,
        "loss": [float(m["loss"]) for m in out],
        "mtp_loss": [float(m["mtp_loss"]) for m in out if "mtp_loss" in m],
        "accept": sum(float(b.get("draft_accept", 0.0)) for b in micro),
        "positions": sum(float(b.get("draft_positions", 0.0)) for b in micro),
    }
    destroy_distributed()
    return result


def step_grads(rank: int, world: int, hf_dir: str, layout: dict, records: list, budget: int, coef: float, mtp: bool):
    """:func:`_one_model` for the model built without (``mtp`` False) or with its MTP layers."""
    return _one_model(hf_dir, layout, mtp, records, budget, coef)


def reference_acceptance(hf_dir: str, records: list) -> tuple[int, int]:
    """The draft's first-token acceptance counted independently: transformers' target forward (its
    post-norm last hidden states) and the published MTP math (``engines.mtp_draft.MTPDraft`` on the
    checkpoint's MTP tensors): position i of a sequence counts when tokens i+1 and i+2 are response
    tokens, and is accepted when argmax of the draft's logits at (h_i, t_{i+1}) is t_{i+2}."""
    import torch

    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.engines.hf_engine import HFRolloutEngine
    from gspo_megatron.engines.mtp_draft import MTPDraft
    from gspo_megatron.models.carried import mtp_names

    engine = HFRolloutEngine(hf_dir, hf_dir)
    model = engine.model
    hf = model.config.to_dict()
    tensors = dict(iter_checkpoint(hf_dir))
    mtp = {k: tensors[k] for k in mtp_names(hf, tensors)}
    draft = MTPDraft(model.config, mtp, model.model.embed_tokens.weight, model.lm_head.weight)
    acc = pos = 0
    with torch.no_grad():
        for r in records:
            ids = torch.tensor(r.prompt_ids + r.response_ids)
            t = len(ids)
            h = model(ids[None], output_hidden_states=True).hidden_states[-1][0]  # [T, H], post-norm
            # MTP inputs j = 0..T-2: (h_j, t_{j+1}) at position j (sglang's pairing; Megatron rolls the
            # positions to j + 1: RoPE sees the same relative positions), predicting t_{j+2}
            _g, logits = draft(h[: t - 1], ids[1:], torch.arange(t - 1))
            p = len(r.prompt_ids)
            for j in range(t - 2):
                if j + 1 >= p:  # t_{j+1} and t_{j+2} are response tokens
                    pos += 1
                    acc += int(int(logits[j].argmax()) == int(ids[j + 2]))
    return acc, pos


def adam_first_step(rank: int, world: int, hf_dir: str, mtp_lr: float | None) -> dict:
    """One rank: the MTP model under ``setup_training`` with ``OptimOptions(lr=1e-3, mtp_lr=...)``, every
    parameter's gradient set to a fixed random tensor, one optimizer step (no clipping, no weight decay).
    Returns {name: (max |step|, min |step| over nonzero gradients)}: Adam's first step is
    lr * g / (|g| + eps), so each is the parameter's learning rate up to eps."""
    import torch
    from megatron.core import parallel_state as ps  # noqa: F401 - initialised by tiny_megatron_model

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    init_distributed(ParallelLayout(), seed=0)
    model = build_model(load_hf_config(hf_dir), opts=ModelOptions(transformer_impl="local", dtype="float32", mtp=True))
    load_hf_weights(model, hf_dir)
    opts = OptimOptions(lr=1e-3, mtp_lr=mtp_lr, clip_grad=0.0, use_distributed_optimizer=False)
    ddp, optimizer, _scheduler = setup_training(model, opts)
    g = torch.Generator().manual_seed(0)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    for p in ddp.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) + 0.5)  # no zero gradient
    optimizer.step()
    out = {}
    for n, p in ddp.module.named_parameters():
        d = (p.detach() - before[n]).abs()
        out[n] = (float(d.max()), float(d.min()))
    destroy_distributed()
    return out


def sglang_draft_loads(rank: int, world: int, hf_dir: str) -> dict:
    """One rank: sglang 0.5.23's draft class for the HF directory ``hf_dir`` (the CPU server's
    ``SglangModel(draft_of=...)``, built as sglang's draft worker builds it), its own parameters poisoned,
    then one ``load_weights`` of the directory's MTP layer (``model.layers.<N>.*`` / ``mtp.*``). Returns the
    class name, the parameters left unwritten, and the loaded ``eh_proj`` (Qwen3-Next's ``fc``) next to the
    directory's."""
    import torch

    from gspo_megatron.cpu_server.sglang_models import SglangModel
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.mtp import mtp_naming
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout())
    hf = load_hf_config(hf_dir)
    naming = mtp_naming(hf)
    target = SglangModel(hf_dir, 1, 0, dtype=torch.float32)
    draft = SglangModel(hf_dir, 1, 0, dtype=torch.float32, draft_of=target, draft_path=hf_dir)
    draft.poison()
    tensors = dict(iter_checkpoint(hf_dir))
    draft.load([(k, tensors[k].clone()) for k in mtp_names(hf, tensors)])
    # sglang's name of eh_proj: deepseek_nextn.py / glm4_moe_nextn.py model.eh_proj, qwen3_next_mtp.py fc
    eh_proj = "model.eh_proj.weight" if naming.after_decoder else "fc.weight"
    out = {
        "class": type(draft.model).__name__,
        "unwritten": draft.unwritten(),
        "eh_proj": (draft.params()[eh_proj].detach().clone(), tensors[naming.own(hf)["eh_proj.weight"]]),
    }
    destroy_distributed()
    return out


def pattern_records(vocab: int, n: int = 8, seed: int = 0) -> list:
    """Samples whose responses count up by one (t_{i+1} = t_i + 1 below ``vocab``) after a random prompt:
    the next-next token is a function of the token the draft reads, so a draft trained on them can learn
    to predict it. Advantages 0 (the policy loss gives no gradient)."""
    import torch

    from gspo_megatron.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(1, vocab, (3,), generator=g).tolist()
        start = int(torch.randint(1, vocab - 12, (1,), generator=g))
        response = list(range(start, start + 8))
        out.append(Sample(prompt_ids=prompt, response_ids=response, engine_logprobs=[-1.0] * 8, advantage=0.0))
    return out


def draft_learning(rank: int, world: int, hf_dir: str, records: list, steps: int, mtp_lr: float) -> list[dict]:
    """One rank: ``steps`` training steps of the trainer's pieces (the old-log-prob pass counting the draft's
    acceptance, the forward-backward with the MTP loss at coefficient 1, ``optimizer_step``) on the same
    ``records``, the MTP layer at its own learning rate ``mtp_lr`` (the policy's 1e-6). Returns per step
    {"accept": accepted / positions before the step's update, "mtp_loss": the step's MTP loss}."""

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.micro_batches import run_schedule
    from gspo_megatron.trainer.optimizer import OptimOptions, optimizer_step, setup_training, zero_grads
    from gspo_megatron.trainer.step import split_batch
    from gspo_megatron.trainer.step_passes import CurrentPolicy

    init_distributed(ParallelLayout(), seed=0)
    model = build_model(load_hf_config(hf_dir), opts=ModelOptions(transformer_impl="local", dtype="float32", mtp=True))
    load_hf_weights(model, hf_dir)
    ddp, opt, sched = setup_training(
        model, OptimOptions(lr=1e-6, mtp_lr=mtp_lr, clip_grad=0.0, use_distributed_optimizer=False, total_steps=steps)
    )
    cfg = _config(0)
    out = []
    for _ in range(steps):
        (micro,) = split_batch(cfg, records, 1, 0, pad_id=0, multiple=1)
        CurrentPolicy(1.0, True, drafts=True).attach_old(ddp, micro, records)
        zero_grads(ddp, opt)
        metrics = run_schedule(ddp, micro, _loss_func(cfg, 1, len(micro), 1.0), forward_only=False, with_drafts=True)
        applied, _norm = optimizer_step(opt, sched)
        assert applied
        accept = sum(float(b.get("draft_accept", 0.0)) for b in micro)
        positions = sum(float(b.get("draft_positions", 0.0)) for b in micro)
        loss = [float(m["mtp_loss"]) for m in metrics if "mtp_loss" in m]
        out.append({"accept": accept / positions, "mtp_loss": sum(loss) / len(loss)})
    destroy_distributed()
    return out
