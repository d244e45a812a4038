"""Loading a dist checkpoint reads each stored tensor straight into its parameter
(gspo_megatron/dist_ckpt_in_place.direct_reads: one preadv instead of torch DCP's buffer, torch.load and
copy_), and gives bitwise the same weights as torch DCP's own reader, in the saved layout and resharded
(where a requested region is strided, that item goes through DCP's reader)."""

from __future__ import annotations

import pytest
import torch

from checkpoint_workers import direct_reads_job
from distributed_harness import run_ranks


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=6, num_hidden_layers=2)[0]


def _same(r: dict) -> bool:
    return sorted(r["a"]) == sorted(r["b"]) and all(torch.equal(r["a"][k], r["b"][k]) for k in r["b"])


def test_same_layout_reads_every_tensor_directly(hf_dir, tmp_path):
    (r,) = run_ranks(direct_reads_job, 1, hf_dir, str(tmp_path / "ckpt"), 1, 1)
    assert r["readers"] == 1 and r["direct_items"] > 0 and r["base_tensor_items"] == 0, (
        r["direct_items"],
        r["base_tensor_items"],
    )
    assert _same(r)


@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 2)])
def test_resharded_load_equals_dcp_reader(hf_dir, tmp_path, save_tp, load_tp):
    results = run_ranks(direct_reads_job, 2, hf_dir, str(tmp_path / "ckpt"), save_tp, load_tp)
    for r in results:
        # row-parallel weights cut along dim 1 are strided regions: those take DCP's reader
        assert r["direct_items"] > 0 and r["base_tensor_items"] > 0, (r["direct_items"], r["base_tensor_items"])
        assert _same(r)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # strided
        lambda: torch.randn(5, 7).to(torch.bfloat16),
        lambda: torch.arange(10.0, dtype=torch.float64)[2:7],  # a storage offset
        lambda: torch.zeros(0, 3),
        lambda: torch.tensor(3.5),
    ],
    ids=["transposed", "bf16", "offset", "empty", "scalar"],
)
def test_saved_tensor_layout_locates_the_bytes_torch_save_wrote(make):
    import io

    from gspo_megatron.checkpoint.in_place_reads import saved_tensor_layout

    t = make()
    buf = io.BytesIO()
    torch.save(t, buf)
    data = buf.getvalue()
    buf.seek(0)
    meta, offset = saved_tensor_layout(buf)
    assert meta.device.type == "meta" and meta.dtype == t.dtype and meta.shape == t.shape
    n = meta.untyped_storage().nbytes()
    assert n == t.untyped_storage().nbytes()
    got = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=t.dtype) if n else torch.empty(0, dtype=t.dtype)
    assert torch.equal(got.as_strided(meta.shape, meta.stride(), meta.storage_offset()), t)


@pytest.mark.parametrize(
    "obj",
    [{"a": 1}, [torch.ones(2)], torch.nn.Parameter(torch.ones(2)), b"raw bytes"],
    ids=["dict", "list", "parameter", "bytes"],
)
def test_saved_tensor_layout_refuses_what_is_not_a_plain_tensor(obj):
    import io
    import pickle
    import zipfile

    from gspo_megatron.checkpoint.in_place_reads import saved_tensor_layout

    buf = io.BytesIO()
    if isinstance(obj, bytes):
        buf.write(obj)
    else:
        torch.save(obj, buf)
    buf.seek(0)
    with pytest.raises((ValueError, pickle.UnpicklingError, zipfile.BadZipFile)):
        saved_tensor_layout(buf)
