"""``Rule.load_into`` (the conversion's direct copy of HF pieces into a parameter) gives exactly
``to_local``'s shard for every rule kind and tensor-parallel rank, and refuses shapes that do not fit
(no silent broadcast)."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.models.mapping import (
    AttentionDims,
    ColumnParallel,
    FusedQKV,
    GatedFC1,
    PermutedRows,
    Replicated,
    RowParallel,
    StackedExpertFC1,
    StackedExpertFC2,
)

DIMS = AttentionDims(num_heads=8, num_query_groups=4, head_dim=3)


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    yield "replicated", Replicated("a", "a"), [r(6)]
    yield "column", ColumnParallel("a", "a", "tp"), [r(8, 5)]
    yield "row", RowParallel("a", "a", "tp"), [r(5, 8)]
    yield "gated_fc1", GatedFC1("a", ("g", "u"), "tp"), [r(8, 5), r(8, 5)]
    yield "qkv_weight", FusedQKV("a", ("q", "k", "v"), DIMS), [r(24, 5), r(12, 5), r(12, 5)]
    yield "qkv_bias", FusedQKV("a", ("q", "k", "v"), DIMS), [r(24), r(12), r(12)]
    yield "permuted", PermutedRows("a", "a", torch.randperm(8, generator=g)), [r(8, 5)]
    yield "stacked_fc1", StackedExpertFC1("a", "a"), [r(5, 8)]
    yield "stacked_fc2", StackedExpertFC2("a", "a"), [r(8, 5)]


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("name,rule,hf", list(_cases()), ids=[c[0] for c in _cases()])
def test_load_into_equals_to_local(name, rule, hf, size):
    for rank in range(size):
        expected = rule.to_local(hf, rank, size)
        param = torch.full_like(expected, float("nan"))
        rule.load_into(param, hf, rank, size)
        assert torch.equal(param, expected), (name, rank, size)


@pytest.mark.parametrize("name,rule,hf", list(_cases()), ids=[c[0] for c in _cases()])
def test_load_into_refuses_a_wrong_shape(name, rule, hf):
    shape = list(rule.to_local(hf, 0, 1).shape)
    shape[0] *= 2  # twice too many rows: a copy_ would broadcast or fail obscurely
    with pytest.raises(ValueError):
        rule.load_into(torch.zeros(shape), hf, 0, 1)
    with pytest.raises(ValueError):
        rule.load_into(torch.zeros(1, *shape), hf, 0, 1)  # one more dim: copy_ would broadcast


@pytest.mark.parametrize("size", [1, 2])
def test_reader_copy_into_reads_the_file(tmp_path, monkeypatch, size):
    """Through SafetensorsReader.copy_into (pread from the file where the piece is a run of it):
    the same values as to_local, for every rule kind and rank, and pread is really used."""
    import os

    from safetensors.torch import save_file

    from gspo_megatron.models.safetensors_reader import SafetensorsReader

    cases = list(_cases())
    tensors = {f"{name}.{i}": t.contiguous() for name, _, hf in cases for i, t in enumerate(hf)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(1) or real(*a))
    reader = SafetensorsReader(str(tmp_path))
    for name, rule, hf in cases:
        for rank in range(size):
            full = [reader.get(f"{name}.{i}") for i in range(len(hf))]
            expected = rule.to_local(hf, rank, size)
            param = torch.full_like(expected, float("nan"))
            rule.load_into(param, full, rank, size, copy=reader.copy_into)
            assert torch.equal(param, expected), (name, rank, size)
            # the parameter's storage stays resizable (rollout.offload_train frees it and brings it back)
            storage = param.untyped_storage()
            nbytes = storage.nbytes()
            storage.resize_(0)
            storage.resize_(nbytes)
    reader.close()
    assert calls
