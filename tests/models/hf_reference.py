"""Independent reference for the conversion tests: transformers' own forward pass.

``hf_logprobs(model, rows)``: per-row lists of log p(token_t | tokens_<t), t = 1..n-1, from a
transformers causal LM in fp32 (one row at a time: no padding involved).
``make_rows(seed, n, vocab)``: token id rows of varied lengths (1 token, odd lengths, longer).
"""

from __future__ import annotations

import torch


def make_rows(seed: int = 0, n: int = 7, vocab: int = 256, max_len: int = 23) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, max_len] + torch.randint(3, max_len, (max(0, n - 3),), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths[:n]]


@torch.no_grad()
def hf_logprobs(model, rows: list[list[int]]) -> list[list[float]]:
    model.eval()
    out = []
    for ids in rows:
        t = torch.tensor([ids])
        logits = model(t).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, t[0, 1:, None]).squeeze(1)
        out.append(lp.tolist())
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over rows; raises if the row count or a row length differs."""
    assert len(a) == len(b), f"{len(a)} rows vs {len(b)}"
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"row {i}: {len(x)} vs {len(y)} values"
        if x:
            worst = max(worst, (torch.tensor(x) - torch.tensor(y)).abs().max().item())
    return worst
