"""Saving a dist checkpoint from the tensors' own memory, in the saving process
(gspo_megatron/checkpoint/writer.py): the checkpoint Megatron's writer makes (same files, same items
at the same offsets, bitwise the same tensors through either reader), without a forked writer or a
Manager server, and a failed write reported to the caller with nothing published."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from checkpoint_workers import direct_writes_job, failed_write_job
from distributed_harness import run_ranks


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=8, num_hidden_layers=2)[0]


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2)], ids=["1rank", "tp2"])
def test_same_checkpoint_as_megatrons_writer_without_its_processes(hf_dir, tmp_path, world, tp):
    results = run_ranks(direct_writes_job, world, hf_dir, str(tmp_path), tp)
    r0 = results[0]
    assert r0["direct_files"] == r0["mcore_files"], (r0["direct_files"], r0["mcore_files"])
    assert r0["direct_layout"] == r0["mcore_layout"]  # every item in the same file, at the same offset and length
    for rank, r in enumerate(results):
        assert r["direct_forks"] == 0 and not r["direct_manager"], (r["direct_forks"], r["direct_manager"])
        # the comparison ran Megatron's own writer: forked writers reporting through its Manager
        assert r["mcore_forks"] > 0 and r["mcore_manager"], (r["mcore_forks"], r["mcore_manager"])
        assert r["files_written"] == sum(f.startswith(f"__{rank}_") for f in r0["direct_files"]) > 0
        for name in ("direct_read_direct", "direct_read_dcp", "mcore_read_direct", "mcore_read_dcp"):
            assert _equal(r["original"], r[name]), name


def test_a_failed_write_raises_and_publishes_nothing(hf_dir, tmp_path):
    (r,) = run_ranks(failed_write_job, 1, hf_dir, str(tmp_path))
    # one line naming the checkpoint, the rank and the cause
    assert r["error"] is not None and "\n" not in r["error"], r["error"]
    assert (
        str(tmp_path / "step") in r["error"] and "rank 0: " in r["error"] and "No space left on device" in r["error"]
    ), r["error"]
    assert "step" not in r["left"], r["left"]  # only the unfinished step.tmp-* directory


def test_exact_storage_shares_the_views_memory():
    from gspo_megatron.checkpoint.writer import exact_storage

    w = torch.arange(24.0).reshape(6, 4)
    gate, up = torch.chunk(w, 2, dim=0)  # how Megatron shards a gated fc1
    e = exact_storage(up)
    assert e.data_ptr() == up.data_ptr() and e.untyped_storage().nbytes() == up.numel() * 4
    assert torch.equal(e, up)
    w[4, 1] = -1.0
    assert e[1, 1] == -1.0  # the same memory, not a copy
    whole = exact_storage(w)
    assert whole.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    cols = w[:, 1:3]  # a strided region: cloned, as Megatron's writer does
    c = exact_storage(cols)
    assert c.data_ptr() != cols.data_ptr() and torch.equal(c, cols) and c.is_contiguous()
    bf = torch.randn(8, 3).to(torch.bfloat16)[2:5]
    assert torch.equal(exact_storage(bf), bf) and exact_storage(bf).dtype == torch.bfloat16


def test_torch_save_of_the_exact_view_writes_only_its_bytes_and_loads_back():
    from gspo_megatron.checkpoint.in_place_reads import saved_tensor_layout
    from gspo_megatron.checkpoint.writer import exact_storage, records_without_crc

    big = torch.randn(1000, 64)
    view = big[400:410]
    bufs = {}

    def save(name, t, no_crc):
        buf = io.BytesIO()
        if no_crc:
            with records_without_crc():
                torch.save(t, buf)
        else:
            torch.save(t, buf)
        bufs[name] = buf.getvalue()

    save("clone", view.clone(), False)
    th = threading.Thread(target=save, args=("exact", exact_storage(view), True))  # as the writer's threads do
    th.start()
    th.join()
    assert torch.serialization.get_crc32_options()  # the setting did not leak out of the writing thread
    assert len(bufs["exact"]) == len(bufs["clone"]) < view.numel() * 4 + 4096
    for data in bufs.values():
        assert torch.equal(torch.load(io.BytesIO(data)), view)
        meta, offset = saved_tensor_layout(io.BytesIO(data))  # also without CRCs
        got = torch.frombuffer(bytearray(data[offset : offset + view.numel() * 4]), dtype=torch.float32)
        assert torch.equal(got.reshape(view.shape), view) and meta.shape == view.shape
