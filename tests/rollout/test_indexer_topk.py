"""sglang's ``meta_info["indexer_topk"]`` (DSA): decoded and validated in one place
(``engines.routing.decode_indexer_topk``): a malformed payload is one error naming engine and request."""

from __future__ import annotations

import numpy as np
import pytest

from gspo_megatron.engines.routing import RoutedExpertsError, decode_indexer_topk, encode_routed_experts


def _selection(n: int, layers: int, k: int) -> np.ndarray:
    sel = np.full((n, layers, k), -1, np.int32)
    for t in range(n):
        keys = list(range(t + 1))[-k:]  # the latest min(t + 1, k) keys
        sel[t, :, : len(keys)] = keys
    return sel


def test_roundtrip():
    sel = _selection(7, 2, 3)
    out = decode_indexer_topk(encode_routed_experts(sel), num_tokens=7, num_layers=2, index_topk=3)
    assert out.dtype == np.int32 and np.array_equal(out, sel)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s[:-1], "expected 7 tokens"),  # a token short
        (lambda s: np.roll(s, -1, axis=0), "outside"),  # shifted one token earlier: row t names key t + 1
        (lambda s: s + 1000, "SGLANG_DSA_FUSE_TOPK=0"),  # KV-pool slots, not positions
        (lambda s: np.where(np.arange(7)[:, None, None] == 5, np.array([1, 1, 2], np.int32), s), "distinct"),
        (lambda s: np.where(np.arange(7)[:, None, None] == 4, -1, s), "distinct"),  # a row with no key
    ],
)
def test_malformed_payload_is_refused(mutate, match):
    bad = mutate(_selection(7, 2, 3))
    with pytest.raises(RoutedExpertsError, match=match) as e:
        decode_indexer_topk(
            encode_routed_experts(bad), num_tokens=7, num_layers=2, index_topk=3, engine="http://e0", request="r7"
        )
    assert "http://e0" in str(e.value) and "r7" in str(e.value)


def test_missing_payload_names_the_flag():
    with pytest.raises(RoutedExpertsError, match="--enable-return-indexer-topk"):
        decode_indexer_topk(None, num_tokens=3, num_layers=1, index_topk=2, engine="e", request="q")


def test_replayed_keep_counts_agreement():
    """``rollout/indexer_agreement``'s counts: rows the engine gave keys for, and those whose own
    selection was already that set (order and -1 filler ignored); rows without keys are not counted."""
    import torch

    from gspo_megatron.models.deepseek_v32.indexer import replayed_keep

    n = 5
    own = torch.zeros(n, n, dtype=torch.bool)
    for s in range(n):
        own[s, max(0, s - 1) : s + 1] = True  # the latest min(s + 1, 2) keys
    replay = torch.tensor([[0, -1], [1, 0], [0, 2], [2, 3], [-1, -1]])  # rows 0, 1, 3 agree; 2 differs; 4 none
    counts = torch.zeros(2, dtype=torch.int64)
    keep = replayed_keep(own, replay, counts)
    assert counts.tolist() == [3, 4]
    assert keep[2].tolist() == [True, False, True, False, False] and torch.equal(keep[4], own[4])
