"""gspo_megatron.checkpoint.safetensors_shards writes, tensor by tensor and in any order (as N ranks do), the
very bytes safetensors.torch.save_file writes for the same tensors, and cuts shards as a sequential
writer does."""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save_file

from gspo_megatron.checkpoint import safetensors_shards as st


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {}
    dtypes = list(st._CODES)
    for i, dtype in enumerate(dtypes * 2):
        shape = [(i % 3) + 1, 5] if i % 4 else [7]
        x = torch.randn(*shape, generator=g) * 10
        out[f"model.layers.{i}.w{i % 5}"] = (x > 0) if dtype == torch.bool else x.to(dtype)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    out["stacked"] = torch.randn(4, 3, 2, generator=g)
    return out


def _write(out_dir, tensors, max_size, rows=False):
    names = list(tensors)
    shards = st.plan_shards([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], max_size)
    st.create_files(out_dir, shards)
    files = st.ShardFiles(out_dir, shards)
    random.Random(1).shuffle(names)  # any write order: the ranks write concurrently
    for n in names:
        if rows and n == "stacked":
            for r in (2, 0, 3, 1):
                files.write(n, tensors[n][r], r)
        else:
            files.write(n, tensors[n])
    files.close()
    return shards, st.finish_files(out_dir, shards)


def test_single_file_bytes_equal_save_file(tmp_path):
    tensors = _tensors()
    _, names = _write(str(tmp_path), tensors, 10**9, rows=True)
    assert names == ["model.safetensors"]
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    for t in tensors.values():  # written without numpy: the storages stay resizable (offload_train)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)


def test_shards_cut_in_stream_order_with_index(tmp_path):
    tensors = _tensors()
    shards, names = _write(str(tmp_path), tensors, 100)
    assert len(names) > 2
    # a sequential writer's cut: a shard closes when the next tensor would overflow it
    size, expected, current = 0, [], []
    for n, t in tensors.items():
        b = t.numel() * t.element_size()
        if current and size + b > 100:
            expected.append(current)
            current, size = [], 0
        current.append(n)
        size += b
    expected.append(current)
    assert [[n for n, _, _ in s.tensors] for s in shards] == expected
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    for group, name in zip(expected, names):
        save_file({n: tensors[n] for n in group}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        assert all(index["weight_map"][n] == name for n in group)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".part-")]
