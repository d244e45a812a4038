"""DSA indexer replay in a GSPO run: gspo-train on a tiny DeepSeek-V3.2 (one indexer head, index_topk 4:
many exact-zero ties, sequences longer than the top-k) with CPU-server engines. The engine (KV cache,
left-padded batch) breaks the indexer's ties by its own row lengths; with ``rollout.routing_replay=r3``
it returns its selection (``--enable-return-indexer-topk``) and routes, the trainer replays both, and
the old log-probs equal the engine's every step (the post-sync probe, ``rollout.sync_verify``, replays
them too); with replay off the same run shows the gap."""

from __future__ import annotations

import pytest

from train_utils import read_metrics, run_train

TIES = dict(index_n_heads=1, index_topk=4)
ENGINES = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "train.steps=2",
    "rollout.max_new_tokens=8",
    "model.max_seq_len=64",
]


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3.2 with the byte-level demo tokenizer (its 259 ids inside the model's 320)."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(tmp_path_factory.mktemp("dsa") / "tiny-deepseek-v32")
    save_tiny_hf_model("deepseek_v32", d, seed=7, vocab_size=320, **TIES)
    build_demo_tokenizer(d)
    return d


def model(d: str) -> list[str]:
    return [f"model.hf_path={d}", "model.init=pretrained", "model.arch=null"]


def test_r3_replays_the_indexer_in_a_run(tmp_path, dsa_dir):
    run_train(
        str(tmp_path / "r3"),
        [
            *ENGINES,
            *model(dsa_dir),
            "rollout.routing_replay=r3",
            "rollout.sync_verify=true",
            "rollout.sync_verify_every=1",
        ],
    )
    rows = read_metrics(str(tmp_path / "r3"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff"] < 1e-4, r
        assert r["sync/verify_max_abs_diff"] < 1e-4, r
        assert 0.0 < r["rollout/indexer_agreement"] < 1.0, r  # the trainer breaks some ties otherwise
    run_train(str(tmp_path / "off"), [*ENGINES, *model(dsa_dir), "rollout.sync_verify=false"])
    off = read_metrics(str(tmp_path / "off"))
    assert all(r["rollout/logprob_abs_diff"] > 1e-3 for r in off), off
    assert all("rollout/indexer_agreement" not in r for r in off)
