"""engines/routing.py: sglang's routed-experts payload decoded, validated and laid on token positions."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gspo_megatron.engines.routing import (
    NO_ROUTE,
    RoutedExpertsError,
    decode_routed_experts,
    encode_routed_experts,
    route_agreement,
    route_tokens,
    routes_on_row,
)

L, K, E = 3, 2, 4


def _routes(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(n)]).astype(np.int32)


def _decode(payload, n, **kw):
    return decode_routed_experts(
        payload, num_tokens=n, num_layers=L, topk=K, num_experts=E, engine="http://e0:1", request="prompt 3", **kw
    )


def test_roundtrip_is_sglangs_encoding():
    r = _routes(5)
    payload = encode_routed_experts(r)
    # sglang: pybase64.b64encode(tensor.numpy().tobytes()) of int32; its helper decodes with np.frombuffer
    assert np.array_equal(np.frombuffer(base64.b64decode(payload), dtype=np.int32), r.reshape(-1))
    out = _decode(payload, 5)
    assert out.dtype == np.int32 and out.shape == (5, L, K) and np.array_equal(out, r)


def test_dense_layers_rows_are_not_validated():
    """DeepSeek's first_k_dense_replace: sglang's capture buffer leaves a dense layer's rows at 0
    (a repeated "expert"); with the model's MoE layers named they pass, an MoE layer's repeat does not."""
    r = _routes(5)
    r[:, 0] = 0
    out = _decode(encode_routed_experts(r), 5, moe_layers=(1, 2))
    assert np.array_equal(out, r)
    with pytest.raises(RoutedExpertsError, match="layer 0 repeats"):
        _decode(encode_routed_experts(r), 5)
    r[2, 2] = 1
    with pytest.raises(RoutedExpertsError, match="token 2, layer 2 repeats"):
        _decode(encode_routed_experts(r), 5, moe_layers=(1, 2))


def test_route_tokens_is_start_to_seqlen_minus_one():
    assert route_tokens(4, 3) == 6
    assert route_tokens(4, 3, start_len=4) == 2  # the response's tokens but its last
    assert route_tokens(1, 0) == 0


@pytest.mark.parametrize(
    "payload,match",
    [
        (None, "missing"),
        (123, "base64 string"),
        ("not base64!!", "not valid base64"),
        (base64.b64encode(b"\x00" * 6).decode(), "whole number of int32"),
    ],
)
def test_malformed_payload_names_engine_and_request(payload, match):
    with pytest.raises(RoutedExpertsError, match=match) as e:
        _decode(payload, 5)
    assert "http://e0:1" in str(e.value) and "prompt 3" in str(e.value)


def test_wrong_token_count_is_refused():
    # one token short: what a route shifted by / cut at one token looks like
    with pytest.raises(RoutedExpertsError, match="expected 5 tokens"):
        _decode(encode_routed_experts(_routes(4)), 5)
    # the layer count or top-k of another model
    with pytest.raises(RoutedExpertsError, match="x 3 layers x top-2"):
        _decode(encode_routed_experts(_routes(5)[:, :2]), 5)


def test_expert_ids_out_of_range_or_repeated_are_refused():
    r = _routes(5)
    r[2, 1, 0] = E
    with pytest.raises(RoutedExpertsError, match=r"expert id 4 at token 2, layer 1 is outside \[0, 4\)"):
        _decode(encode_routed_experts(r), 5)
    r[2, 1, 0] = -1
    with pytest.raises(RoutedExpertsError, match="outside"):
        _decode(encode_routed_experts(r), 5)
    r = _routes(5)
    r[1, 2] = [3, 3]
    with pytest.raises(RoutedExpertsError, match="token 1, layer 2 repeats"):
        _decode(encode_routed_experts(r), 5)


def test_routes_on_row_put_token_t_at_position_t():
    r = _routes(6)  # prompt 4 + response 3: 6 routed tokens
    row = routes_on_row(r, 7, L, K)
    assert np.array_equal(row[:6], r) and (row[6] == NO_ROUTE).all()
    # response-only routes (routed_experts_start_len = prompt_len)
    row = routes_on_row(r[4:], 7, L, K, start_len=4)
    assert (row[:4] == NO_ROUTE).all() and np.array_equal(row[4:6], r[4:]) and (row[6] == NO_ROUTE).all()
    with pytest.raises(RoutedExpertsError, match="does not fit"):
        routes_on_row(r[1:], 7, L, K)
    assert (routes_on_row(None, 3, L, K) == NO_ROUTE).all()


def test_route_agreement_ignores_order_and_unrouted_positions():
    a = _routes(4)
    b = a[:, :, ::-1].copy()  # same sets, other order
    b[0, 0] = [x for x in range(E) if x not in a[0, 0]][:K]
    b[3] = NO_ROUTE
    assert route_agreement(a, b) == (3 * L - 1, 3 * L)
