"""The delta loader under sglang's expert parallelism (``--ep-size``): each engine TP rank keeps a host
copy of only the routed experts it loads, asked of sglang 0.5.23's own ``FusedMoE`` layer, and its
weights after a full and then a delta sync are bitwise those of plain ``load_weights`` full syncs.

Two gloo ranks build sglang's own model class at TP 2 x EP 2 (``cpu_server/sglang_models.py``) for
Qwen3-MoE, DeepSeek-V3 (shared experts beside the routed ones) and Mixtral (its own expert naming):
one model per rank loaded through ``delta_loader.apply_deltas`` with ``DeltaEncoder`` payloads, one
through ``load_weights`` with the full tensors. The experts a rank keeps are checked against the
range sglang's layout gives EP rank r (``[r * E / 2, (r + 1) * E / 2)``), written out here.

The expert location metadata is installed as sglang's model runner installs it (the trivial map by
default, for which ``FusedMoE.weight_loader`` maps each checkpoint expert through
``logical_to_all_physical``); ``qwen3_moe_eplb`` starts the engine with an EPLB placement
(``--init-expert-location`` with a ``physical_to_logical_map`` that differs per layer), so the experts a
rank loads differ per layer: the kept set is checked against that map, written out here.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

pytest.importorskip("sglang")

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3_moe_eplb")


def _eplb_map(layers: int, experts: int) -> list[list[int]]:
    """physical_to_logical_map [layers, experts]: layer l's physical slot p holds logical ``(p + l + 1) % E``."""
    return [[(p + layer + 1) % experts for p in range(experts)] for layer in range(layers)]


def _eplb_arg(hf_dir: str) -> str:
    import json
    import os

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    return json.dumps(
        {
            "physical_to_logical_map": _eplb_map(
                cfg["num_hidden_layers"], cfg.get("num_experts") or cfg["num_local_experts"]
            )
        }
    )


def _changed(hf: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change: a few elements of every tensor (a delta, not a full send)."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for n, t in hf.items():
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] += 0.01 * torch.randn(idx.numel(), generator=g, dtype=flat.dtype)
        out[n] = t
    return out


def _buckets(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Per layer: its other tensors (DeepSeek's q_a / kv_a pair together, as the export's fuse groups
    keep them), then its routed experts in two buckets, the first half's and the second's (on EP
    rank 1 the first holds nothing it loads); the rest (embeddings, final norm, head) last."""
    from gspo_megatron.models.registry import expert_weight

    layers: dict[int, list[str]] = {}
    rest = []
    for n in sorted(state):
        if n.startswith("model.layers."):
            layers.setdefault(int(n.split(".")[2]), []).append(n)
        else:
            rest.append(n)
    out = []
    for names in layers.values():
        experts = [n for n in names if expert_weight(n) is not None]
        count = max((expert_weight(n)[0] for n in experts), default=-1) + 1
        out.append([n for n in names if n not in experts])
        out += [
            b
            for b in (
                [n for n in experts if expert_weight(n)[0] < count // 2],
                [n for n in experts if expert_weight(n)[0] >= count // 2],
            )
            if b
        ]
    return [*out, rest]


def _run(rank, world, dirs: dict):
    from gspo_megatron.cpu_server.sglang_models import SglangModel
    from gspo_megatron.cpu_server.weights import iter_checkpoint
    from gspo_megatron.weight_sync.delta import DeltaEncoder
    from gspo_megatron.weight_sync.delta_loader import apply_deltas, host_copy

    out = {}
    for kind, hf_dir in dirs.items():
        location = _eplb_arg(hf_dir) if kind.endswith("_eplb") else "trivial"
        by_delta = SglangModel(hf_dir, world, rank, ep_size=2, dtype=torch.float32, init_expert_location=location)
        by_full = SglangModel(hf_dir, world, rank, ep_size=2, dtype=torch.float32, init_expert_location=location)
        by_delta.poison()
        by_full.poison()
        enc = DeltaEncoder()
        hf = dict(iter_checkpoint(hf_dir))
        kinds = []
        for step in range(3):  # a full sync, then two delta syncs
            state = hf if step == 0 else _changed(hf, step)
            hf = state
            for names in _buckets(state):
                bucket = [(n, state[n]) for n in names]
                apply_deltas(by_delta.model, enc.encode_bucket(bucket))
                by_full.load([(n, t.clone()) for n, t in bucket])
            kinds.append(dict(enc.stats.encodings))
            enc.begin()
        a, b = by_delta.params(), by_full.params()
        out[kind] = dict(
            unwritten=by_delta.unwritten() + by_full.unwritten(),
            same=sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a),
            differ=[n for n in a if not torch.equal(a[n], b[n])][:5],
            kept=sorted(host_copy(by_delta.model)),
            names=sorted(hf),
            encodings=kinds,
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    dirs = {}
    for kind in FAMILIES:
        d = tmp_path_factory.mktemp(kind)
        save_tiny_hf_model(kind.removesuffix("_eplb"), str(d))
        dirs[kind] = str(d)
    return run_ranks(_run, 2, dirs, timeout=900)


@pytest.mark.parametrize("kind", FAMILIES)
def test_delta_loader_keeps_only_this_ep_ranks_experts_and_loads_bitwise(results, kind):
    from gspo_megatron.models.registry import expert_weight

    for rank, res in enumerate(results):
        r = res[kind]
        assert r["same"] and not r["unwritten"], (rank, r["differ"], r["unwritten"][:5])
        assert r["encodings"][0]["full"] > 0 and r["encodings"][-1]["full"] == 0, r["encodings"]  # deltas after
        experts = {n: expert_weight(n)[0] for n in r["names"] if expert_weight(n) is not None}
        count = max(experts.values()) + 1
        assert count % 2 == 0 and len(experts) > 0
        if kind.endswith("_eplb"):  # rank r holds physical slots [r * E / 2, (r + 1) * E / 2) of each layer
            layers = 1 + max(int(n.split(".")[2]) for n in experts)
            table = _eplb_map(layers, count)
            held = {
                (lay, table[lay][p]) for lay in range(layers) for p in range(rank * count // 2, (rank + 1) * count // 2)
            }
            mine = {n for n, e in experts.items() if (int(n.split(".")[2]), e) in held}
            assert len({e for n, e in experts.items() if n in mine and n.startswith("model.layers.0.")}) == count // 2
        else:
            mine = {n for n, e in experts.items() if rank * count // 2 <= e < (rank + 1) * count // 2}
        dense = set(r["names"]) - set(experts)
        assert set(r["kept"]) == dense | mine, (rank, sorted(set(r["kept"]) ^ (dense | mine))[:5])
        assert len(mine) * 2 == len(experts)
