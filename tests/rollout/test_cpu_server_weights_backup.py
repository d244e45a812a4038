"""``--enable-weights-cpu-backup`` (sglang 0.5.23 ``arg_groups/fields/exec_.py``): a weights release
keeps a host copy and the resume restores it, so an engine nobody syncs (a distillation teacher)
scores as before; without it the resumed weights are zeros until the next sync, as with sglang's
memory saver alone. Checked by the prompt log-probs of one sequence, tp 2."""

from __future__ import annotations

import json
import urllib.request

import pytest

from cpu_server_util import CpuServer

IDS = [5, 17, 33, 2, 9, 41, 7]


def _post(url: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}/{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def _scores(url: str) -> list[float]:
    out = _post(
        url,
        "generate",
        {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
    )
    return [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]


@pytest.mark.parametrize("backup", [True, False], ids=["cpu_backup", "no_backup"])
def test_release_and_resume_keep_the_weights_only_with_cpu_backup(model_dir, tmp_path, backup):
    flags = ("--enable-memory-saver", "--enable-weights-cpu-backup") if backup else ("--enable-memory-saver",)
    s = CpuServer(model_dir, str(tmp_path), tp=2, extra=flags)
    try:
        before = _scores(s.url)
        _post(s.url, "release_memory_occupation", {})
        _post(s.url, "resume_memory_occupation", {})
        after = _scores(s.url)
    finally:
        s.stop()
    if backup:
        assert after == before
    else:  # zero weights: every token equally likely
        assert after != before and max(after) - min(after) < 1e-6, after
