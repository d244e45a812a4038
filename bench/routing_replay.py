"""Routing replay (issue 24) side by side: route agreement and the engine/trainer log-prob gap
without replay, with R2 and with R3, for engines that route differently from the trainer.

The engine is the CPU server's (``engines.hf_engine.HFRolloutEngine`` with the server's
``cpu_server.routes.RouteRecorder``, in process): fp32 with ``--router-logit-perturbation`` (a fixed
random change of the engine's router logits only), bf16 (the server's ``--dtype bfloat16``: the whole
engine forward in bf16, the trainer in fp32), and both. The trainer is Megatron-Core (1 rank, fp32,
the trainer's own code: ``trainer.step.split_batch`` / ``_attach_logprobs`` / ``train_on_batch``).

Per engine and mode (off | r2 | r3), on the same engine samples:

- ``agree_used``: share of (token, layer) top-k sets where the experts the trainer's old-policy
  forward used equal the engine's (tokens with an engine route: not the last token, not padding);
- ``agree_own``: the same for the router's own choice before replay (``rollout/route_agreement``);
- ``gap_mean`` / ``gap_max``: |trainer old log-prob - engine log-prob| over the response tokens;
- ``moved``: after one optimizer step (``--lr``; ``gspo.mini_batches=2``, the second mini-batch's policy
  forward), the share of labelled (token, layer) sets whose experts differ from the old forward's.

Run: ``python bench/routing_replay.py [--perturbation 3.0] [--lr 0.01] [--prompts 8] [--output f.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

PROMPT_IDS = [
    [5, 17, 42, 9, 33, 2],
    [100, 3],
    [7, 8, 9],
    [61, 62, 63, 64, 65],
    [11],
    [90, 91, 92, 93],
    [40, 41, 12],
    [77, 78, 79, 80, 81, 82, 83],
]


def engine_records(hf_dir: str, dtype: torch.dtype, perturb: float, prompts: int, new_tokens: int, seed: int = 3):
    """Samples from the CPU server's engine (its transformers model in ``dtype``, routes recorded,
    the router's choice perturbed by ``perturb``): engine log-probs + routed experts."""
    from gspo_megatron.cpu_server.routes import RouteRecorder
    from gspo_megatron.engines.base import SamplingParams
    from gspo_megatron.engines.hf_engine import HFRolloutEngine
    from gspo_megatron.sample import Sample

    engine = HFRolloutEngine(hf_dir, hf_dir, dtype=dtype, seed=seed)
    rec = RouteRecorder(engine.model, perturb)
    ids = (PROMPT_IDS * (prompts // len(PROMPT_IDS) + 1))[:prompts]
    out = engine._generate_batch(
        ids, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), torch.Generator().manual_seed(seed), rec
    )
    return [
        Sample(
            prompt_ids=list(s.prompt_ids),
            response_ids=list(s.response_ids),
            engine_logprobs=list(s.response_logprobs),
            routed_experts=s.routed_experts,
            advantage=float(i % 3) - 1.0,
        )
        for i, s in enumerate(out)
    ]


def _log_router_calls(ddp) -> list:
    """(layer, ids used) of every router call of ``ddp``, in call order (a no-replay RouteReplay is
    installed for mode off, so that its calls are seen too)."""
    from gspo_megatron.trainer.route_replay import _owner

    state = _owner(ddp).__dict__["_gspo_route_replay"]
    log: list = []
    for rep in state.replays:

        def wrapped(scores, topk, *a, _orig=rep.get_replay_topk, _rep=rep, **kw):
            probs, ids = _orig(scores, topk, *a, **kw)
            log.append((_rep.layer, ids.detach().clone()))
            return probs, ids

        rep.get_replay_topk = wrapped
    return log


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def measure(hf_dir: str, records: list, mode: str, lr: float) -> dict:
    """One fresh trainer (the HF weights) per call; see the module docstring for the columns."""
    from gspo_megatron.config import load_config
    from gspo_megatron.engines.routing import NO_ROUTE
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
    from gspo_megatron.trainer.packing import ROUTES_KEY
    from gspo_megatron.trainer.route_replay import local_targets, replay_phase, route_replay_for
    from gspo_megatron.trainer.step import _attach_logprobs, split_batch, train_on_batch

    model = build_model(load_hf_config(hf_dir), opts=ModelOptions(transformer_impl="local", dtype="float32"))
    load_hf_weights(model, hf_dir)
    ddp, opt, sched = setup_training(model, OptimOptions(lr=lr, use_distributed_optimizer=False))
    route_replay_for(ddp, "r2" if mode == "off" else mode)  # off: installed, never in a replaying phase
    log = _log_router_calls(ddp)
    cfg = load_config(
        None,
        [
            "parallel.micro_batch_size=4",
            "gspo.mini_batches=2",
            f"rollout.routing_replay={mode}",
            "rollout.engine=sglang",
            "rollout.engine_server=cpu",
            "rollout.sync_mode=colocated",
        ],
    )
    minis = split_batch(cfg, records, 1, 0, pad_id=0, multiple=1)
    flat = [b for m in minis for b in m]
    with replay_phase(ddp, mode, "old" if mode != "off" else None) as state:
        _attach_logprobs(ddp, flat, "old_logprobs", 1.0)
        own = state.take_agreement() if state is not None and mode == "r3" else None
    layers = len({c[0] for c in log})
    used = [[log[i * layers + j][1] for j in range(layers)] for i in range(len(flat))]  # [micro][layer]
    agree = [0, 0]
    gaps = []
    for b, per_layer in zip(flat, used):
        for layer, ids in enumerate(per_layer):
            tgt = local_targets(b[ROUTES_KEY], layer)
            valid = (tgt != NO_ROUTE).all(-1)
            agree[0] += int((_same(ids, tgt) & valid).sum())
            agree[1] += int(valid.sum())
        m = b["loss_mask"].bool()
        gaps.append((b["old_logprobs"] - b["engine_logprobs"]).abs()[m])
    gap = torch.cat(gaps)
    # one step of two mini-batches: the second one's policy forward runs after an update
    log.clear()
    metrics = train_on_batch(cfg, ddp, opt, sched, records, pad_id=0).metrics
    n0 = len(minis[0])
    old_calls = log[: len(flat) * layers]
    second = log[(len(flat) + n0) * layers :]
    moved = [0, 0]
    for k, (layer, ids) in enumerate(second):
        b = flat[n0 + k // layers]
        before = old_calls[(n0 + k // layers) * layers + layer][1]
        valid = (local_targets(b[ROUTES_KEY], layer) != NO_ROUTE).all(-1)
        moved[0] += int((~_same(ids, before) & valid).sum())
        moved[1] += int(valid.sum())
    return {
        "agree_used": agree[0] / max(agree[1], 1),
        "agree_own": own[0] / own[1] if own else agree[0] / max(agree[1], 1),
        "gap_mean": float(gap.mean()),
        "gap_max": float(gap.max()),
        "moved": moved[0] / max(moved[1], 1),
        "route_agreement_metric": metrics.get("rollout/route_agreement"),
        "logprob_abs_diff_metric": metrics["rollout/logprob_abs_diff"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perturbation", type=float, default=3.0, help="the engine's --router-logit-perturbation")
    ap.add_argument("--lr", type=float, default=0.01, help="learning rate of the one update ('moved')")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--output", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from gspo_megatron.models.tiny import save_tiny_hf_model
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    p = args.perturbation
    engines = [
        (f"fp32, perturbation {p:g}", torch.float32, p),
        ("bf16", torch.bfloat16, 0.0),
        (f"bf16, perturbation {p:g}", torch.bfloat16, p),
    ]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        save_tiny_hf_model("qwen3_moe", hf_dir, seed=5)
        init_distributed(ParallelLayout(), seed=0)
        try:
            for name, dtype, perturb in engines:
                records = engine_records(hf_dir, dtype, perturb, args.prompts, args.max_new_tokens)
                results[name] = {mode: measure(hf_dir, records, mode, args.lr) for mode in ("off", "r2", "r3")}
        finally:
            destroy_distributed()
    head = (
        f"{'engine (trainer: fp32)':<26} {'mode':<4} {'agree_used':>10} {'agree_own':>9} "
        f"{'gap_mean':>9} {'gap_max':>9} {'moved':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, per_mode in results.items():
        for mode, r in per_mode.items():
            print(
                f"{name:<26} {mode:<4} {r['agree_used']:>10.4f} {r['agree_own']:>9.4f} {r['gap_mean']:>9.2e} "
                f"{r['gap_max']:>9.2e} {r['moved']:>7.4f}"
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
