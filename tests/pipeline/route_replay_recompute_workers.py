"""Rank functions and records of tests/pipeline/test_route_replay_recompute.py (module level: spawned
ranks import them).

``skewed`` rewrites the records' routes into ones the trainer's routers would not choose: every
token's first expert is expert 0 (an uneven load: it gets every token), the others random. ``grads`` runs ``train_on_batch``
on a fresh model per (routing_replay, model.recompute) run and returns each run's metrics, the
gradients it left in the DDP buffers (the last mini-batch's) and how many router calls replayed
targets inside a backward (the recomputed forwards)."""

from __future__ import annotations


def skewed(records: list, num_experts: int, seed: int = 0) -> list:
    """The records with routes no router picks by itself (module docstring)."""
    import dataclasses

    import numpy as np

    g = np.random.default_rng(seed)
    out = []
    for r in records:
        routes = np.array(r.routed_experts)  # [n - 1, L, K]
        n, layers, k = routes.shape
        for t in range(n):
            for layer in range(layers):
                routes[t, layer] = [0, *(1 + g.permutation(num_experts - 1)[: k - 1])]
        out.append(dataclasses.replace(r, routed_experts=routes.astype(np.int32)))
    return out


def _count_backward_calls(model, mode: str) -> list:
    """Wrap each router's replay and DSA selection: count the calls that replay targets inside a
    backward (a recomputed forward): [router calls, indexer selections]."""
    import torch

    from gspo_megatron.trainer.route_replay import route_replay_for

    counter = [0, 0]
    state = route_replay_for(model, mode)
    for rep in state.replays:

        def wrapped(scores, topk, *a, _orig=rep.get_replay_topk, _rep=rep, **kw):
            if _rep.targets is not None and torch._C._current_graph_task_id() != -1:
                counter[0] += 1
            return _orig(scores, topk, *a, **kw)

        rep.get_replay_topk = wrapped
    for att in state.indexers:

        def select(*a, _orig=att._select, _att=att, **kw):
            if _att.indexer_replay is not None and torch._C._current_graph_task_id() != -1:
                counter[1] += 1
            return _orig(*a, **kw)

        att._select = select
    return counter


def grads(rank: int, world: int, layout: dict, hf_dir: str, records: list, runs: list[tuple], lr: float = 0.5) -> dict:
    """{(mode, recompute, mini_batches): {"metrics", "grads" (name -> tensor), "backward_replays"}}
    per run; ``runs``: (routing_replay mode, model.recompute, gspo.mini_batches). Each run starts
    from the checkpoint's weights (``lr``: large, so that with two mini-batches the second's routing has moved)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
    from gspo_megatron.trainer.step import train_on_batch
    from route_replay_workers import _config

    out = {}
    hf = load_hf_config(hf_dir)
    for mode, recompute, minis in runs:
        init_distributed(ParallelLayout(**layout, sequence_parallel=layout.get("tp", 1) > 1), seed=0)
        opts = ModelOptions(transformer_impl="local", dtype="float32", recompute=recompute)
        model = build_model(hf, layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), opts=opts)
        load_hf_weights(model, hf_dir)
        ddp, opt, sched = setup_training(model, OptimOptions(lr=lr, use_distributed_optimizer=False))
        counter = _count_backward_calls(ddp, mode) if mode != "off" else [0, 0]
        cfg = _config(0, mode, mbs=2, extra=(f"gspo.mini_batches={minis}", f"model.recompute={str(recompute).lower()}"))
        metrics = train_on_batch(cfg, ddp, opt, sched, records, pad_id=0).metrics
        out[(mode, recompute, minis)] = {
            "metrics": metrics,
            "grads": {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters() if p.requires_grad},
            "backward_replays": counter[0],
            "backward_selections": counter[1],
            "last_stage": ps.is_pipeline_last_stage(),
        }
    destroy_distributed()
    return out
