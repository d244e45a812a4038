"""Rank functions running Megatron-Core's real forward-backward schedule with the GSPO loss function.

A tiny position-independent "LM" (embedding -> linear to the vocab) stands in for GPTModel: its output
is logits [b, s, V] like GPTModel's with labels=None, and packing rows does not change the logits,
so padded and packed micro-batches must give the same gradients.
"""

from __future__ import annotations

import torch

from gspo_megatron.losses import (
    PolicyLossConfig,
    check_megatron_config,
    make_megatron_logprob_func,
    make_megatron_loss_func,
    policy_loss_flat,
    seq_index_from_cu_seqlens,
    vocab_parallel_logprobs,
)

VOCAB, HIDDEN, TEMPERATURE = 16, 8, 0.9


def make_sequences(seed: int = 0, n: int = 8):
    """n sequences: (tokens [L], first response position P); one sequence has no response."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        prompt = int(torch.randint(1, 4, (1,), generator=g))
        response = 0 if i == 5 else int(torch.randint(1, 6, (1,), generator=g))
        seqs.append((torch.randint(0, VOCAB, (prompt + response,), generator=g), prompt))
    return seqs


def token_fields(tokens: torch.Tensor, prompt: int):
    """Per position p: input tokens[p], label tokens[p + 1], mask 1 if tokens[p + 1] is a response token."""
    inputs = tokens
    labels = torch.cat([tokens[1:], tokens.new_zeros(1)])
    mask = (torch.arange(tokens.numel()) + 1 >= prompt).float()
    mask[-1] = 0.0
    return inputs, labels, mask


class TinyLM(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def set_input_tensor(self, tensor):
        pass

    def forward(self, tokens):  # [b, s] -> logits [b, s, V]
        return self.out(torch.tanh(self.embed(tokens)))


def build_model(seed: int = 0):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)
    check_megatron_config(config)
    torch.manual_seed(seed)
    return TinyLM(config)


def old_and_adv(seqs, model, seed: int = 1):
    """old log-probs per sequence (current policy + noise, so some ratios are clipped) and advantages."""
    g = torch.Generator().manual_seed(seed)
    olds = []
    with torch.no_grad():
        for tokens, prompt in seqs:
            inputs, labels, _ = token_fields(tokens, prompt)
            lp, _ = vocab_parallel_logprobs(
                model(inputs[None]), labels[None], temperature=TEMPERATURE, with_entropy=False
            )
            olds.append(lp[0] + torch.randn(tokens.numel(), generator=g) * 1e-2)
    return olds, torch.randn(len(seqs), generator=g)


def padded_batch(seqs, olds, adv, idx, normalizer):
    """A padded micro-batch of sequences ``idx``: one per row."""
    length = max(seqs[i][0].numel() for i in idx)
    b = len(idx)
    batch = {k: torch.zeros(b, length, dtype=torch.long) for k in ("tokens", "labels", "seq_index")}
    batch.update({k: torch.zeros(b, length) for k in ("loss_mask", "old_logprobs")})
    for row, i in enumerate(idx):
        tokens, prompt = seqs[i]
        inputs, labels, mask = token_fields(tokens, prompt)
        n = tokens.numel()
        batch["tokens"][row, :n] = inputs
        batch["labels"][row, :n] = labels
        batch["loss_mask"][row, :n] = mask
        batch["old_logprobs"][row, :n] = olds[i]
        batch["old_logprobs"][row, n:] = float("nan")  # padding garbage must not leak
        batch["seq_index"][row] = row
    batch["advantages"] = adv[idx]
    batch["normalizer"] = normalizer
    return batch


def packed_batch(seqs, olds, adv, idx, normalizer, pad: int = 3):
    """A packed (THD) micro-batch: sequences ``idx`` concatenated in one row, then ``pad`` padding tokens."""
    parts = [token_fields(*seqs[i]) for i in idx]
    lengths = torch.tensor([seqs[i][0].numel() for i in idx])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(cu[-1]) + pad
    cat = lambda j, fill: torch.cat([torch.cat([p[j] for p in parts]), torch.full((pad,), fill)])
    return {
        "tokens": cat(0, 0)[None],
        "labels": cat(1, 0)[None],
        "loss_mask": cat(2, 0.0)[None],
        "old_logprobs": torch.cat([torch.cat([olds[i] for i in idx]), torch.full((pad,), float("nan"))])[None],
        "seq_index": seq_index_from_cu_seqlens(cu, total)[None],
        "advantages": adv[idx],
        "normalizer": normalizer,
    }


def reference_grads(cfg: PolicyLossConfig, seed: int = 0):
    """Whole global batch in one loss call, no Megatron: (loss, {name: grad})."""
    seqs = make_sequences(seed)
    model = build_model(seed)
    olds, adv = old_and_adv(seqs, model)
    batch = packed_batch(seqs, olds, adv, list(range(len(seqs))), None, pad=0)
    logits = model(batch["tokens"])
    lp, ent = vocab_parallel_logprobs(logits, batch["labels"], temperature=TEMPERATURE)
    loss, _ = policy_loss_flat(
        lp[0],
        batch["old_logprobs"][0],
        adv,
        batch["loss_mask"][0],
        batch["seq_index"][0],
        len(seqs),
        cfg,
        entropy=ent[0],
    )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def normalizer_for(cfg: PolicyLossConfig, seqs) -> float:
    counts = [float(token_fields(*s)[2].sum()) for s in seqs]
    if cfg.aggregation == "token-mean":
        return sum(counts)
    return float(sum(1 for c in counts if c > 0))


def schedule_worker(rank: int, world: int, runs: list[tuple]) -> list:
    """Run :func:`schedule_run` for each (cfg, layout, num_micro, average_in_collective) in ``runs``."""
    return [schedule_run(rank, world, *run) for run in runs]


def schedule_run(
    rank: int,
    world: int,
    cfg: PolicyLossConfig,
    layout: str,
    num_micro: int,
    average_in_collective: bool | None,
    seed: int = 0,
):
    """Run get_forward_backward_func() on this DP rank's share of the global batch.

    layout: "padded" or "packed"; average_in_collective: None -> no DDP wrapper (plain .grad), else
    Megatron DDP with that setting. Returns (sum of metrics['loss'] over micro-batches, {name: grad},
    the largest clip fraction of a micro-batch).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    seqs = make_sequences(seed)
    model = build_model(seed)
    olds, adv = old_and_adv(seqs, model)
    dp = ps.get_data_parallel_world_size()
    assert dp == world
    normalizer = normalizer_for(cfg, seqs)
    mine = list(range(len(seqs)))[rank::dp]  # this DP rank's sequences
    groups = [mine[i::num_micro] for i in range(num_micro)]
    make = padded_batch if layout == "padded" else packed_batch
    micro = [make(seqs, olds, adv, idx, normalizer) for idx in groups]

    use_ddp = average_in_collective is not None
    if use_ddp:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, average_in_collective=average_in_collective
        )
        model = DistributedDataParallel(model.config, ddp_config, model)
        model.config.no_sync_func = model.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()

    def forward_step(data_iterator, model_):
        batch = next(data_iterator)
        logits = model_(batch["tokens"])
        loss_func = make_megatron_loss_func(
            batch,
            cfg,
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            num_microbatches=num_micro,
            data_parallel_size=dp,
            temperature=TEMPERATURE,
        )
        return logits, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=num_micro,
        seq_length=0,
        micro_batch_size=0,
        forward_only=False,
    )
    loss_sum = sum(m["loss"] for m in out)
    if use_ddp:
        grads = {n.removeprefix("module."): p.main_grad.clone() for n, p in model.named_parameters()}
    else:
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss_sum, grads, max(m["clip_fraction"] for m in out)


def logprob_worker(rank: int, world: int, num_micro: int, seed: int = 0):
    """Forward-only schedule collecting per-token log-probs and entropies of packed micro-batches;
    returns (collected, direct) lists of (logprobs, entropy) per micro-batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    seqs = make_sequences(seed)
    model = build_model(seed)
    olds, adv = old_and_adv(seqs, model)
    micro = [packed_batch(seqs, olds, adv, list(range(len(seqs)))[i::num_micro], 1.0) for i in range(num_micro)]

    def forward_step(data_iterator, model_):
        batch = next(data_iterator)
        return model_(batch["tokens"]), make_megatron_logprob_func(
            batch, tp_group=ps.get_tensor_model_parallel_group(), temperature=TEMPERATURE, with_entropy=True
        )

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=num_micro,
        seq_length=0,
        micro_batch_size=0,
        forward_only=True,
    )
    with torch.no_grad():
        direct = [vocab_parallel_logprobs(model(b["tokens"]), b["labels"], temperature=TEMPERATURE) for b in micro]
    return [(o["logprobs"], o["entropy"]) for o in out], direct
