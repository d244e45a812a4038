"""Which directories count as checkpoints (no distributed run needed): temporary directories of an
interrupted save are ignored, incomplete or corrupt ones are skipped with a warning, the newest
complete one wins, and explicit paths fail with a message naming the problem."""

from __future__ import annotations

import json
import os

import pytest

from gspo_megatron.checkpoint import manager as ck


def fake_checkpoint(path, step: int, marker: bool = True, meta: bool | str = True) -> str:
    os.makedirs(os.path.join(path, ck.DIST_SUBDIR))
    for name in ("metadata.json", ".metadata"):
        open(os.path.join(path, ck.DIST_SUBDIR, name), "w").write("{}")
    if meta is True:
        json.dump({"step": step, "hf_config": {}, "layout": {}}, open(os.path.join(path, ck.META_FILE), "w"))
    elif meta:
        open(os.path.join(path, ck.META_FILE), "w").write(meta)
    if marker:
        open(os.path.join(path, ck.MARKER_FILE), "w").write(f"{step}\n")
    return str(path)


def test_newest_complete_wins_and_tmp_dirs_are_ignored(tmp_path):
    fake_checkpoint(tmp_path / "step_000002", 2)
    fake_checkpoint(tmp_path / "step_000010", 10)
    fake_checkpoint(tmp_path / "step_000020.tmp-abcdef", 20)  # an interrupted save
    assert [s for s, _ in ck.list_checkpoints(str(tmp_path))] == [2, 10]
    assert ck.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_000010")
    assert ck.resolve_checkpoint(str(tmp_path)) == [str(tmp_path / "step_000010"), str(tmp_path / "step_000002")]


@pytest.mark.parametrize("damage", ["no_marker", "no_meta", "bad_meta", "no_dist_metadata"])
def test_damaged_newest_is_skipped_with_warning(tmp_path, damage):
    fake_checkpoint(tmp_path / "step_000001", 1)
    newest = fake_checkpoint(
        tmp_path / "step_000002",
        2,
        marker=damage != "no_marker",
        meta={"no_meta": False, "bad_meta": "{not json"}.get(damage, True),
    )
    if damage == "no_dist_metadata":
        os.remove(os.path.join(newest, ck.DIST_SUBDIR, ".metadata"))
    with pytest.warns(UserWarning, match="step_000002"):
        assert ck.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_000001")
    with pytest.raises(ck.CheckpointError, match="step_000002"):
        ck.resolve_checkpoint(newest)  # named explicitly: an error, no fallback


def test_empty_or_missing_root(tmp_path):
    assert ck.latest_checkpoint(str(tmp_path)) is None
    assert ck.load_checkpoint(str(tmp_path / "nothing"), model=None) is None
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.resolve_checkpoint(str(tmp_path / "nothing"))
    fake_checkpoint(tmp_path / "step_000003.tmp-1", 3)
    with pytest.raises(ck.CheckpointError, match="no checkpoint"):
        ck.resolve_checkpoint(str(tmp_path))
