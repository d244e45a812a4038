"""Multi-turn routes (custom rollouts under ``rollout.routing_replay=r3``): each position of the final
sequence gets the route of the engine call that ran that token in that context; tool output is
routed by the next call's prefill; tokens no call ran carry NO_ROUTE (the trainer routes them)."""

from __future__ import annotations

import numpy as np
import pytest

from gspo_megatron.engines.routing import NO_ROUTE, RoutedExpertsError, compose_routes

L, K = 2, 2


def _routes(n: int, tag: int) -> np.ndarray:
    """[n, L, K] routes whose value names the call (tag) and the position: tag * 100 + position."""
    r = np.zeros((n, L, K), np.int32)
    r[:] = (tag * 100 + np.arange(n))[:, None, None]
    return r


def test_two_turns_with_tool_output():
    prompt, out1, tool, out2 = [1, 2, 3], [4, 5], [6, 7, 8], [9, 10]
    tokens = prompt + out1 + tool + out2  # 10 tokens
    call1 = (prompt, out1, _routes(len(prompt) + len(out1) - 1, 1))
    p2 = prompt + out1 + tool
    call2 = (p2, out2, _routes(len(p2) + len(out2) - 1, 2))
    got = compose_routes(tokens, [call1, call2])
    assert got.shape == (9, L, K)
    # the second call ran every position 0..8 (its prompt at prefill, tool output included): it wins
    assert (got[:, 0, 0] == 200 + np.arange(9)).all()


def test_trailing_tool_output_has_no_route_and_first_call_covers_its_part():
    prompt, out1, tool = [1, 2, 3], [4, 5], [6, 7]
    tokens = prompt + out1 + tool  # the hook ended on a tool turn: no call ran 6, 7
    got = compose_routes(tokens, [(prompt, out1, _routes(4, 1))])
    assert (got[:4, 0, 0] == 100 + np.arange(4)).all()  # tokens 0..3 (the last output token 5 was never input)
    assert (got[4:] == NO_ROUTE).all()  # token 5 (last sampled), 6 (tool): the trainer routes them


def test_a_call_whose_context_differs_is_used_only_on_the_shared_prefix():
    tokens = [1, 2, 3, 4, 5, 6]
    other = ([1, 2, 9], [5], _routes(3, 7))  # context diverges at position 2
    got = compose_routes(tokens, [([1, 2, 3, 4], [5, 6], _routes(5, 1)), other])
    assert got[:2, 0, 0].tolist() == [700, 701]  # later call, same prefix
    assert got[2:, 0, 0].tolist() == [102, 103, 104]  # only the first call ran these in this context


def test_no_routes_and_bad_shape():
    assert compose_routes([1, 2, 3], [([1], [2, 3], None)]) is None
    with pytest.raises(RoutedExpertsError, match="shape"):
        compose_routes([1, 2, 3], [([1], [2, 3], _routes(3, 1))])
