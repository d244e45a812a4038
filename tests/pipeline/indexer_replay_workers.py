"""Rank functions and records of the DSA indexer-replay tests (module level: spawned ranks import them).

``make_dsa_records`` generates with the transformers engine (the CPU server's ``HFRolloutEngine``:
KV cache, left-padded batch) recording its routes (``RouteRecorder``) and its indexer selection
(``IndexerRecorder``), unperturbed: the engine and the trainer differ only where the indexer's
exact-zero ties are broken differently by rows of other lengths. ``dsa_gaps`` runs the trainer's
old-policy forward (``route_replay_workers._gap``) padded and packed, without replay, with r3, and with
r3 fed an indexer selection shifted one token later."""

from __future__ import annotations

PROMPTS = [
    [5, 17, 42, 9, 33, 2, 8, 70, 71, 12],
    [100, 3],
    [7, 8, 9, 10, 11, 12, 13],
    [61, 62, 63, 64, 65],
    [11],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 40, 41],
]


def make_dsa_records(hf_dir: str, max_new_tokens: int = 12, seed: int = 3) -> list:
    """Samples (engine log-probs, routed experts, indexer selection) from one left-padded batch."""
    import torch

    from gspo_megatron.cpu_server.routes import IndexerRecorder, RouteRecorder
    from gspo_megatron.engines.base import SamplingParams
    from gspo_megatron.engines.hf_engine import HFRolloutEngine
    from gspo_megatron.sample import Sample

    engine = HFRolloutEngine(hf_dir, hf_dir, seed=seed)
    out = engine._generate_batch(
        PROMPTS,
        SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens),
        torch.Generator().manual_seed(seed),
        RouteRecorder(engine.model),
        IndexerRecorder(engine.model),
    )
    return [
        Sample(
            prompt_ids=list(s.prompt_ids),
            response_ids=list(s.response_ids),
            engine_logprobs=list(s.response_logprobs),
            routed_experts=s.routed_experts,
            indexer_topk=s.indexer_topk,
            advantage=float(i % 3) - 1.0,
        )
        for i, s in enumerate(out)
    ]


def shifted_selection(records: list) -> list:
    """The records with each query's indexer selection moved one token later (query t gets query
    t-1's keys, all causal; query 0 keeps its own)."""
    import dataclasses

    import numpy as np

    out = []
    for r in records:
        sel = np.array(r.indexer_topk)
        sel[1:] = r.indexer_topk[:-1]
        out.append(dataclasses.replace(r, indexer_topk=sel))
    return out


def dsa_gaps(rank: int, world: int, layouts: list[dict], hf_dir: str, records: list) -> list:
    """Per layout: {(padded|packed, off|r3|r3_shifted): route_replay_workers._gap(...)}."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.runtime.distributed import destroy_distributed
    from route_replay_workers import _config, _gap
    from tiny_models import tiny_megatron_model

    results = []
    for layout in layouts:
        ddp, _, _ = tiny_megatron_model(hf_dir, layout)
        entry = {}
        for name, budget in (("padded", 0), ("packed", 256)):
            for mode, recs in (("off", records), ("r3", records), ("r3_shifted", shifted_selection(records))):
                m = "off" if mode == "off" else "r3"
                entry[(name, mode)] = _gap(ddp, _config(budget, m), recs, ps, m)
        results.append(entry)
    destroy_distributed()
    return results
