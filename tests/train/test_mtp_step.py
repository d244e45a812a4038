"""The training step with the checkpoint's MTP layers in the model (``model.mtp``, ``gspo.mtp_loss_coef``):

- the policy is untouched by the draft: old log-probs and the gradient of every non-MTP parameter are
  bitwise those of the same checkpoint built without MTP layers, with the MTP loss off (coefficient 0:
  the MTP layers get no gradient at all) and on (they get one; the policy's gradients still equal);
- the draft's first-token acceptance counted in the old-log-prob pass
  (``losses/mtp_loss.draft_acceptance``) equals an independent count: transformers' target forward and
  the published MTP math on the checkpoint's tensors (``engines.mtp_draft.MTPDraft``);
padded and packed micro-batches, one rank (with and without ``model.recompute``, which checkpoints the
MTP layer too) and TP 2 / EP 2 / PP 2 on two gloo ranks (PP: the MTP layer on the last stage with its own
copy of the embedding, whose gradient is the first stage's), GLM-4.5's tiny config (MoE MTP layer); one rank
on Qwen3-Next's (the ``mtp.*`` branch: a full-attention MoE layer after the hybrid stack), where the draft is
also trained for a few steps (its own ``optimizer.mtp_lr``) on responses whose next-next token it can infer:
its exact acceptance rises and its loss falls (it does not with a learning rate of 0)."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from mtp_step_workers import (
    adam_first_step,
    draft_learning,
    make_records,
    pattern_records,
    reference_acceptance,
    sglang_draft_loads,
    step_grads,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
    from mtp_util import write_mtp_checkpoint

    path = str(tmp_path_factory.mktemp("glm4_moe_mtp"))
    hf, _model, _mtp = write_mtp_checkpoint(path, "glm4_moe", seed=3)
    return path, hf


def _both(world: int, *args) -> list[dict]:
    """Per rank {"plain": ..., "mtp": ...}: the step pieces on the model built without and with its MTP
    layers (two launches: one process group per launch)."""
    plain = run_ranks(step_grads, world, *args, False)
    mtp = run_ranks(step_grads, world, *args, True)
    return [{"plain": a, "mtp": b} for a, b in zip(plain, mtp)]


STEPS_TO_LEARN = 12


def _is_mtp(name: str) -> bool:
    return ".mtp." in f".{name}"


# PP > 1: the last stage's copy of the embedding, which megatron builds for the MTP layer (models/mtp.py)
EMBEDDING_COPY = "embedding.word_embeddings.weight"


def _check(res: dict, coef: float, first_embedding_grad: torch.Tensor | None = None) -> None:
    """``first_embedding_grad`` (PP > 1): the first stage's embedding gradient in the model without MTP."""
    plain, mtp = res["plain"], res["mtp"]
    for a, b in zip(plain["old"], mtp["old"]):
        assert torch.equal(a, b)
    pp = first_embedding_grad is not None
    copy = pp and mtp["last"] and EMBEDDING_COPY not in plain["grads"]
    if copy:  # its own gradient is 0 (a detached input of the MTP layer); finalize_model_grads all-reduces
        # it with the first stage's, so both copies take the same step
        assert torch.equal(mtp["grads"].pop(EMBEDDING_COPY), first_embedding_grad)
    assert copy == (pp and mtp["last"])
    assert set(plain["grads"]) == {n for n in mtp["grads"] if not _is_mtp(n)}
    for name, g in plain["grads"].items():
        assert torch.equal(g, mtp["grads"][name]), name
    drafts = {n: g for n, g in mtp["grads"].items() if _is_mtp(n)}
    if pp and not mtp["last"]:
        assert not drafts  # the MTP layer lives on the last stage
        return
    assert drafts, "the MTP model has no mtp.* parameters"
    if coef == 0:
        assert all(float(g.abs().sum()) == 0.0 for g in drafts.values())
        assert not mtp["mtp_loss"]
    else:
        assert sum(float(g.abs().sum()) for g in drafts.values()) > 0
        assert mtp["mtp_loss"] and all(x > 0 for x in mtp["mtp_loss"])


@pytest.mark.parametrize(
    "budget,coef,recompute",
    [(0, 0.0, False), (0, 0.5, False), (32, 0.0, False), (32, 0.5, False), (32, 0.5, True)],
    ids=["padded-coef0", "padded", "packed-coef0", "packed", "packed-recompute"],
)
def test_policy_untouched_and_acceptance_exact_one_rank(checkpoint, budget, coef, recompute):
    path, hf = checkpoint
    records = make_records(hf["vocab_size"])
    res = _both(1, path, {"recompute": recompute}, records, budget, coef)[0]
    _check(res, coef)
    acc, pos = reference_acceptance(path, records)
    assert res["mtp"]["positions"] == pos > 0
    assert res["mtp"]["accept"] == acc


def test_policy_untouched_and_acceptance_exact_qwen3_next(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
    from mtp_util import write_mtp_checkpoint

    path = str(tmp_path / "qwen3_next_mtp")
    hf, _model, _mtp = write_mtp_checkpoint(path, "qwen3_next", seed=3)
    records = make_records(hf["vocab_size"])
    res = _both(1, path, {}, records, 32, 0.5)[0]
    _check(res, 0.5)
    acc, pos = reference_acceptance(path, records)
    assert res["mtp"]["positions"] == pos > 0
    assert res["mtp"]["accept"] == acc

    # the draft learns: trained by the step's MTP loss on responses whose next-next token it can infer,
    # its exact acceptance (counted in the old-log-prob pass before each update) rises from the published
    # layer's and its loss falls
    steps = run_ranks(draft_learning, 1, path, pattern_records(hf["vocab_size"]), STEPS_TO_LEARN, 1e-2)[0]
    first, last = steps[0], steps[-1]
    assert last["mtp_loss"] < 0.75 * first["mtp_loss"], steps  # measured: 1.24 -> 0.66
    assert last["accept"] >= first["accept"] + 0.5, steps  # measured: 0.0 -> 1.0 (from the sixth step)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"pp": 2}], ids=["tp2", "ep2", "pp2"])
def test_policy_untouched_and_acceptance_exact_two_ranks(checkpoint, layout):
    path, hf = checkpoint
    records = make_records(hf["vocab_size"])
    results = _both(2, path, layout, records, 32, 0.5)
    acc, pos = reference_acceptance(path, records)
    first = results[0]["plain"]["grads"].get(EMBEDDING_COPY) if layout.get("pp") else None
    for res in results:
        _check(res, 0.5, first)
    # TP 2: both ranks hold every sequence and count the same (the argmax is reduced over TP);
    # EP 2: two data-parallel replicas, each counting its own sequences; PP 2: the last stage counts
    if layout.get("pp"):
        (last,) = [r["mtp"] for r in results if r["mtp"]["last"]]
        assert (last["positions"], last["accept"]) == (pos, acc)
    elif layout.get("tp"):
        assert all(r["mtp"]["positions"] == pos and r["mtp"]["accept"] == acc for r in results)
    else:
        assert sum(r["mtp"]["positions"] for r in results) == pos
        assert sum(r["mtp"]["accept"] for r in results) == acc


def test_the_draft_has_its_own_learning_rate(checkpoint):
    """``optimizer.mtp_lr``: the MTP layer is a param group of its own (megatron's config overrides): Adam's
    first step moves each of its parameters by mtp_lr * g / (|g| + eps), every other one by lr's; without
    it, all by lr."""
    path, _hf = checkpoint
    for mtp_lr in (None, 1e-2):
        (steps,) = run_ranks(adam_first_step, 1, path, mtp_lr)
        for name, (hi, lo) in steps.items():
            lr = mtp_lr if mtp_lr is not None and _is_mtp(name) else 1e-3
            assert hi == pytest.approx(lr, rel=1e-3) and lo == pytest.approx(lr, rel=1e-2), (name, hi, lo, lr)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_sglangs_draft_class_loads_the_mtp_branch(tmp_path, family):
    """sglang 0.5.23's draft class of the ``mtp.*`` families (``Qwen3NextForCausalLMMTP``, the text
    checkpoint's ``Qwen3_5ForCausalLMMTP``; the vision-language one: tests/train/test_speculative_run.py),
    built as its draft worker builds it, writes every parameter of its own from the checkpoint's MTP layer."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model(family, str(tmp_path), seed=0, with_mtp=True)
    (draft,) = run_ranks(sglang_draft_loads, 1, str(tmp_path))
    want = {"qwen3_next": "Qwen3NextForCausalLMMTP", "qwen3_5_moe": "Qwen3_5ForCausalLMMTP"}[family]
    assert draft["class"] == want and draft["unwritten"] == []
    assert torch.equal(*draft["eh_proj"])
