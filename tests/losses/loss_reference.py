"""Independent reference for the policy losses: plain-Python loops over sequences and tokens giving the
loss value and the closed-form gradient d loss / d logprob_t (and d loss / d entropy_t).

Written from the formulas in SPEC section 1 (not from the implementation): per sequence i with
n_i response tokens, normalizer D (default: number of non-empty sequences, or tokens for token-mean).
"""

from __future__ import annotations

import math


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _cut(ratio: float, adv: float, lo: float, hi: float) -> bool:
    """True where min(rA, clip(r)A) takes the clipped, constant branch (zero gradient)."""
    return (adv > 0 and ratio > hi) or (adv < 0 and ratio < lo)


def reference_loss(
    lp,
    old,
    adv,
    mask,
    *,
    mode,
    clip_low,
    clip_high,
    aggregation="seq-mean-token-mean",
    ref=None,
    kl_coef=0.0,
    kl_estimator="k3",
    ent=None,
    ent_coef=0.0,
    engine=None,
    tis_cap=None,
    normalizer=None,
):
    """lp, old, mask, ref, ent, engine: lists of rows (lists of floats); adv: list (per seq) or rows.

    Returns (loss, grad_lp rows, grad_ent rows)."""
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    B = len(lp)
    token_adv = isinstance(adv[0], list)
    seqs = [[t for t in range(len(lp[i])) if mask[i][t]] for i in range(B)]
    if normalizer is None:
        if aggregation == "seq-mean-token-mean":
            normalizer = sum(1 for s in seqs if s)
        else:
            normalizer = sum(len(s) for s in seqs)
        normalizer = max(normalizer, 1)
    D = float(normalizer)
    loss = 0.0
    g_lp = [[0.0] * len(row) for row in lp]
    g_ent = [[0.0] * len(row) for row in lp]
    for i, toks in enumerate(seqs):
        n = len(toks)
        if n == 0:
            continue
        w_agg = 1.0 / n if aggregation == "seq-mean-token-mean" else 1.0
        log_s = sum(lp[i][t] - old[i][t] for t in toks) / n
        s = math.exp(log_s)
        tis_seq = 1.0
        if tis_cap is not None:
            tis_seq = min(math.exp(sum(old[i][t] - engine[i][t] for t in toks) / n), tis_cap)
        if mode == "gspo":
            a = adv[i]
            obj = min(s * a, _clip(s, lo, hi) * a)
            loss -= tis_seq * obj / D
            if not _cut(s, a, lo, hi):
                for t in toks:
                    g_lp[i][t] -= tis_seq * a * s / n / D
        else:
            for t in toks:
                a = adv[i][t] if token_adv else adv[i]
                if mode == "gspo_token":
                    r, w = s, tis_seq
                else:  # grpo
                    r = math.exp(lp[i][t] - old[i][t])
                    w = 1.0 if tis_cap is None else min(math.exp(old[i][t] - engine[i][t]), tis_cap)
                obj = min(r * a, _clip(r, lo, hi) * a)
                loss -= w * w_agg * obj / D
                if not _cut(r, a, lo, hi):
                    g_lp[i][t] -= w * w_agg * a * r / D
        for t in toks:
            if kl_coef:
                d = lp[i][t] - ref[i][t]
                k, dk = {
                    "k1": (d, 1.0),
                    "k2": (0.5 * d * d, d),
                    "k3": (math.exp(-d) - 1.0 + d, 1.0 - math.exp(-d)),
                }[kl_estimator]
                loss += kl_coef * w_agg * k / D
                g_lp[i][t] += kl_coef * w_agg * dk / D
            if ent_coef:
                loss -= ent_coef * w_agg * ent[i][t] / D
                g_ent[i][t] -= ent_coef * w_agg / D
    return loss, g_lp, g_ent
