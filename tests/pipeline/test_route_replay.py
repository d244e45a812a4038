"""trainer/route_replay.py inside Megatron-Core's own top-k routing function (no model, no process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from gspo_megatron.engines.routing import NO_ROUTE, route_agreement
from gspo_megatron.trainer.route_replay import MaskedRouteReplay, router_targets

B, S, L, K, E = 2, 5, 3, 2, 6


def _routing(logits_sbe, replay=None):
    """Megatron's routing of [s, b, E] logits as TopKRouter.routing flattens them: [s * b, E]."""
    probs, rmap = topk_routing_with_score_function(
        logits_sbe.reshape(-1, E), K, score_function="softmax", router_replay=replay
    )
    return probs, rmap


def _ids(rmap):
    return torch.stack([torch.nonzero(r).flatten() for r in rmap])  # sorted ids per token


def test_replay_routed_rows_keep_own_routing_on_unrouted_rows():
    torch.manual_seed(0)
    logits = torch.randn(S, B, E)
    own_probs, own_map = _routing(logits)
    routes = torch.full((B, S, L, K), NO_ROUTE)
    g = torch.Generator().manual_seed(1)
    for b in range(B):
        for s in range(S - 1 - b):  # row 1 has one padding position more; the last position of each has no route
            for layer in range(L):
                routes[b, s, layer] = torch.randperm(E, generator=g)[:K]
    layer = 1
    rep = MaskedRouteReplay(layer)
    rep.targets = router_targets(routes, layer)
    probs, rmap = _routing(logits, rep)
    ids = _ids(rmap)
    own = _ids(own_map)
    for b in range(B):
        for s in range(S):
            row = s * B + b  # the router's s-major token order
            tgt = routes[b, s, layer]
            if (tgt == NO_ROUTE).any():  # padding / last token: exactly the router's own choice, never a target
                assert torch.equal(ids[row], own[row]) and torch.allclose(probs[row], own_probs[row])
            else:
                assert torch.equal(ids[row], tgt.sort().values), (b, s)
    # the router's own routing was recorded before the replay (for rollout/route_agreement)
    assert torch.equal(rep.own.sort(-1).values, own)
    agree, total = route_agreement(routes[:, :, layer].numpy(), rep.own.reshape(S, B, K).transpose(0, 1).numpy())
    assert total == sum(S - 1 - b for b in range(B)) and 0 <= agree <= total


def test_shifted_or_transposed_routes_land_on_other_tokens():
    """router_targets must use the [s, b] order: the [b, s] order (or a one-token shift) replays
    another token's route, which this check sees."""
    routes = torch.arange(B * S * L * K).reshape(B, S, L, K)  # unique per (token, layer): an index check only
    tgt = router_targets(routes, 0)
    assert torch.equal(tgt[3 * B + 1], routes[1, 3, 0])
    wrong = routes[:, :, 0].reshape(B * S, K)  # b-major
    assert not torch.equal(wrong[3 * B + 1], routes[1, 3, 0])
    shifted = router_targets(torch.roll(routes, 1, dims=1), 0)
    assert not torch.equal(shifted[3 * B + 1], routes[1, 3, 0])


def test_no_targets_is_plain_routing():
    torch.manual_seed(2)
    logits = torch.randn(S, B, E)
    rep = MaskedRouteReplay(0)
    probs, rmap = _routing(logits, rep)
    ref_probs, ref_map = _routing(logits)
    assert torch.equal(rmap, ref_map) and torch.allclose(probs, ref_probs)
    assert np.array_equal(np.sort(rep.own.numpy(), -1), _ids(ref_map).numpy())


# -- routes on collated rows (trainer.packing.lay_routes) -------------------------------------------------


def _records(lengths=(7, 3, 5), prompt=2, seed=0):
    from gspo_megatron.sample import Sample

    g = np.random.default_rng(seed)
    out = []
    for n in lengths:
        routes = np.stack([np.stack([g.permutation(E)[:K] for _ in range(L)]) for _ in range(n - 1)]).astype(np.int32)
        out.append(Sample.from_tokens(list(range(1, n + 1)), prompt, routed_experts=routes))
    return out


def test_routes_on_padded_and_packed_rows():
    from gspo_megatron.trainer.micro_batches import collate
    from gspo_megatron.trainer.packing import collate_packed

    recs = _records()
    padded = collate(recs, multiple=4)
    r = padded["routed_experts"]
    assert r.shape == (3, 8, L, K) and r.dtype == torch.int32
    packed = collate_packed(recs, seg_multiple=2, row_multiple=4)
    cu = packed["cu_seqlens"].tolist()
    for i, s in enumerate(recs):
        n = s.length
        assert torch.equal(r[i, : n - 1], torch.from_numpy(s.routed_experts))  # token t's route at position t
        assert (r[i, n - 1 :] == NO_ROUTE).all()  # last token and padding: no route
        a = cu[i]
        assert torch.equal(packed["routed_experts"][0, a : a + n - 1], torch.from_numpy(s.routed_experts))
        assert (packed["routed_experts"][0, a + n - 1 : cu[i + 1]] == NO_ROUTE).all()
    assert (packed["routed_experts"][0, cu[len(recs)] :] == NO_ROUTE).all()  # the tail padding segment
    # exactly the positions with a label carry a route (the positions the engine ran a forward on)
    assert torch.equal((r != NO_ROUTE).all(-1).all(-1), padded["labels"] != -100)
    with pytest.raises(ValueError, match="sequence 1: routed_experts has shape"):
        collate(
            [
                recs[0],
                recs[1].__class__(recs[1].prompt_ids, recs[1].response_ids, routed_experts=recs[0].routed_experts),
            ]
        )


def test_packed_routes_follow_their_tokens_through_the_cp_split():
    from gspo_megatron.trainer.packing import collate_packed, split_packed_for_context_parallel

    recs = _records((8, 4, 12))
    whole = collate_packed(recs, seg_multiple=4, row_multiple=4)
    for rank in (0, 1):
        local = split_packed_for_context_parallel(whole, 2, rank)
        for t in range(local["tokens"].shape[1]):
            pos = (
                (whole["tokens"][0] == local["tokens"][0, t])
                & (whole["seq_index"][0] == local["seq_index"][0, t])
                & (whole["position_ids"][0] == local["position_ids"][0, t])
            )
            (j,) = torch.nonzero(pos).flatten().tolist()
            assert torch.equal(local["routed_experts"][0, t], whole["routed_experts"][0, j])


def test_padding_of_a_padded_batch_keeps_the_routers_own_choice():
    """A collated right-padded batch through the router's own top-k: padding rows (and each sequence's
    last token) are routed by the router itself, every other row by the engine's route."""
    from gspo_megatron.trainer.micro_batches import collate
    from gspo_megatron.trainer.route_replay import local_targets

    recs = _records((7, 3, 5))
    batch = collate(recs, multiple=4)
    b, s = batch["tokens"].shape
    torch.manual_seed(3)
    logits = torch.randn(s, b, E)
    _, own_map = _routing(logits)
    for layer in range(L):
        rep = MaskedRouteReplay(layer)
        rep.targets = local_targets(batch["routed_experts"], layer)
        _, rmap = _routing(logits, rep)
        ids, own = _ids(rmap), _ids(own_map)
        for bi, rec in enumerate(recs):
            for si in range(s):
                row = si * b + bi
                if si < rec.length - 1:
                    assert torch.equal(ids[row], torch.from_numpy(np.sort(rec.routed_experts[si, layer])).long())
                else:
                    assert torch.equal(ids[row], own[row]), (bi, si)


def test_sequence_parallel_targets_are_this_ranks_chunk():
    from gspo_megatron.trainer.route_replay import local_targets

    routes = torch.arange(B * 8 * L * K).reshape(B, 8, L, K)
    whole = local_targets(routes, 1)
    parts = [local_targets(routes, 1, r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat(parts), whole)  # [s, b] order: rank r holds positions r*s/tp .. (r+1)*s/tp
    assert torch.equal(parts[1][0], routes[0, 4, 1])


def test_r2_replays_the_old_forwards_own_routes_not_on_padding():
    from gspo_megatron.trainer.route_replay import R2_KEY, RouteReplay

    state = object.__new__(RouteReplay)  # the state machine without a Megatron model
    state.mode, state.phase, state.agree, state.compared, state.sp_rank, state.sp_size = "r2", "old", 0, 0, 0, 1
    state.replays = [MaskedRouteReplay(0)]
    labels = torch.tensor([[4, 5, -100, -100], [6, 7, 8, -100]])  # [b, s]
    batch = {"labels": labels}
    torch.manual_seed(0)
    logits = torch.randn(4, 2, E)
    state.before_forward(batch)
    assert state.replays[0].targets is None  # the old forward routes by itself
    _, own_map = _routing(logits, state.replays[0])
    state.after_forward(batch)
    rec = batch[R2_KEY][0]
    valid = (labels != -100).T.reshape(-1)  # router order
    assert (rec[~valid] == NO_ROUTE).all() and torch.equal(rec[valid].sort(-1).values, _ids(own_map)[valid])
    state.phase = "policy"
    state.before_forward(batch)
    assert state.replays[0].targets is rec
    _, rmap = _routing(torch.randn(4, 2, E), state.replays[0])  # the weights moved: other logits
    assert torch.equal(_ids(rmap)[valid], _ids(own_map)[valid])
