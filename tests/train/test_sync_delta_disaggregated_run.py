"""The assembled disaggregated delta-sync path (``rollout.sync_mode=disaggregated``,
``rollout.sync_delta=true``, weight_sync/delta_http.py): gspo-train under torchrun, 2 ranks as two
pipeline stages, a CPU-server engine of TP 2 launched beside them; the same run with full syncs (the
gloo broadcast) must learn the same (same metrics, same seed), every engine TP rank must equal the
trainer's HF export bitwise after every sync (tests/topology/sync_check.py, one request at a time)."""

from __future__ import annotations

from test_sync_delta_run import full_and_delta_runs

# engines on their own (CPU) "GPUs": rank 0 launches them after the training ranks; two pipeline stages,
# so two source ranks send their own stage's tensors to an engine of TP 2 (one payload per TP rank)
DISAGGREGATED = [
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "rollout.engine_tp=2",
    "parallel.pp=2",
]


def test_disaggregated_delta_sync_learns_as_full_sync_and_engines_match_bitwise(tmp_path):
    """Disaggregated delta (weight_sync/delta_http.py): the same learning metrics as the NCCL (gloo)
    full sync, every engine TP rank bitwise equal to the trainer's export after every sync, later syncs
    a fraction of the bytes, and the sync's files removed after each sync."""
    _, delta_rows = full_and_delta_runs(tmp_path, DISAGGREGATED, engines=1)
    for r in delta_rows:  # at lr 1e-4 most bf16 elements of this tiny model change; some tensors (norms)
        assert r["sync/delta_wire_bytes"] < r["sync/delta_full_bytes"], r  # change whole: both kinds in a file
    assert any(r["sync/delta_tensors_full"] > 0 for r in delta_rows)
    leftover = tmp_path / "delta" / "sync_delta"
    assert not leftover.exists() or not any(leftover.iterdir()), list(leftover.iterdir())
