"""The assembled owner-direct colocated sync (``rollout.sync_owner_direct=true``,
weight_sync/owner_direct.py): gspo-train under torchrun with expert-parallel training, colocated
CPU-server engines. Routed experts reach each engine TP rank from the rank that holds them (shared
memory on one node; one ``dist.send`` per node that lacks the owner) instead of the world broadcast.
The run (full syncs, and delta syncs encoded by the holders) must learn exactly as the same run
with the plain colocated sync (same seed, same metrics),
every engine TP rank must equal the trainer's HF export bitwise after every sync
(tests/topology/sync_check.py), and each rank must receive less than the whole model."""

from __future__ import annotations

from test_sync_delta_run import _learning, _run

# two colocated engines of TP 1 (sglang without --ep-size: each engine TP rank loads every expert),
# training with EP 2: each rank owns half of the experts and reads the other half from its neighbour
EP2 = ["parallel.ep=2"]


def _same_learning(a: list[dict], b: list[dict]) -> list:
    return [
        (x["step"], k, x.get(k), y.get(k))
        for x, y in zip(_learning(a), _learning(b))
        for k in sorted(set(x) | set(y))
        if x.get(k) != y.get(k)
    ]


def _checked(checks: list[dict], engines: int) -> None:
    assert len(checks) >= 5  # the first sync + one per step
    for c in checks:
        assert not c["mismatches"] and len(c["engines"]) == engines and all(e["checked"] for e in c["engines"]), c


def test_owner_direct_sync_learns_as_the_broadcast_and_engines_match_bitwise(tmp_path):
    """The broadcast, owner-direct full syncs and owner-direct delta syncs (each rank encoding what it
    serves): three runs with one seed, the same learning metrics, every engine TP rank bitwise equal
    to the export after every sync."""
    full_rows, full_checks = _run(tmp_path, "full", EP2)
    od_rows, od_checks = _run(tmp_path, "owner_direct", [*EP2, "rollout.sync_owner_direct=true"])
    delta_rows, delta_checks = _run(
        tmp_path, "owner_direct_delta", [*EP2, "rollout.sync_owner_direct=true", "rollout.sync_delta=true"]
    )
    for checks in (full_checks, od_checks, delta_checks):
        _checked(checks, 2)
    for rows in (od_rows, delta_rows):
        diff = _same_learning(full_rows, rows)
        assert len(rows) == len(full_rows) and not diff, diff[:20]
    for f, o in zip(full_rows, od_rows):
        # the broadcast gives every rank the whole model; owner-direct, each rank receives the
        # tensors every rank gets and the experts it owns (the other half it reads from its neighbour)
        assert f["sync/bytes_max_rank"] == f["sync/bytes"], f
        assert o["sync/bytes_max_rank"] < 0.9 * f["sync/bytes_max_rank"], (o, f)
    for d in delta_rows:  # summed over the ranks (each encodes what it serves: what it receives)
        assert d["sync/delta_full_bytes"] == d["sync/bytes_total"], d
        assert 0 < d["sync/delta_wire_bytes"] < d["sync/delta_full_bytes"], d  # at lr 1e-4 most elements change
