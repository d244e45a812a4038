"""A non-finite loss / gradient norm skips the optimizer update on every rank and is counted."""

import random

import torch

from distributed_harness import run_ranks
from gspo_megatron.sample import Sample


def _records(seed: int) -> list[Sample]:
    g = random.Random(seed)
    out = []
    for _ in range(8):
        p, r = g.randint(3, 6), g.randint(1, 3)
        out.append(
            Sample.from_tokens(
                [g.randint(0, 255) for _ in range(p + r)], p, engine_logprobs=[-5.0] * r, advantage=g.gauss(0, 1)
            )
        )
    return out


def _worker(rank, world, out_dir):
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
    from gspo_megatron.trainer.step import train_on_batch

    cfg = load_config(
        None, [f"output_dir={out_dir}", "parallel.micro_batch_size=2", "gspo.mini_batches=2", f"parallel.ep={world}"]
    )
    init_distributed(ParallelLayout(ep=world))
    hf_dir = factory.hf_init_dir(cfg)
    model = factory.build_model(cfg, load_hf_config(hf_dir))
    load_hf_weights(model, hf_dir)
    ddp, opt, sched = setup_training(model, OptimOptions(lr=1e-3))
    good = train_on_batch(cfg, ddp, opt, sched, _records(0), 0)
    with torch.no_grad():  # poison one router weight: the loss and gradient norm become NaN
        dict(model.named_parameters())["decoder.layers.0.mlp.router.weight"][0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = train_on_batch(cfg, ddp, opt, sched, _records(1), 0)
    unchanged = all(
        torch.equal(torch.nan_to_num(before[n]), torch.nan_to_num(p.detach())) for n, p in model.named_parameters()
    )
    assert "_nonfinite_step" not in bad.metrics  # the flag is a field of the result, not a metric
    return good.metrics["train/skipped_updates"], bad.metrics["train/skipped_updates"], float(bad.nonfinite), unchanged


def test_nonfinite_step_is_skipped_everywhere(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path))
    for good_skipped, bad_skipped, flagged, unchanged in results:
        assert good_skipped == 0
        assert bad_skipped == 2  # both mini-batches skipped
        assert flagged == 1.0
        assert unchanged  # no update touched the weights
