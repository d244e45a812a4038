"""The assembled path a user runs, for each 2026 family (qwen3_5_moe, qwen3_next, deepseek_v32,
glm_moe_dsa, minimax_m2): an HF directory written by transformers 5.23's ``save_pretrained`` (the
family's tiny config, every feature of the published one) -> ``gspo-train`` under ``torchrun`` on 2
ranks with expert parallelism (qwen3_next: TP2 x EP2, experts ETP1) and a CPU-server SGLang engine
(disaggregated, the post-sync log-prob probe after every sync) -> the final HF export.

Checked per family:
- every step the engine's and the trainer's old log-probs agree (``rollout/logprob_abs_diff`` < 1e-4,
  fp32) and so does the post-sync probe (``sync/verify_max_abs_diff`` < 1e-4);
- DSA families: the prompts are longer than ``index_topk`` (so the indexer's sparse selection is the
  path run) and ``rollout.routing_replay=r3`` replays the engine's indexer choices and routes
  (tests/train/test_indexer_replay_run.py: without it CPU ties make the two sides select differently);
- ``hf_final`` loads in transformers as the family's own class, and its log-probs on rows longer than
  ``index_topk`` equal a Megatron forward of the run's final checkpoint (the trainer's weights at
  export, read back by ``tools/score.py`` on one rank) within 1e-4, and differ from the initial model's
  (the run trained).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from train_utils import (
    CPU_ENGINE_DISAGGREGATED,
    read_metrics,
    run_train,
    score_checkpoint,
    write_demo_tokenized_checkpoint,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from hf_reference import hf_logprobs, max_abs_diff

ENGINE = [*CPU_ENGINE_DISAGGREGATED, "train.steps=2"]
EP2 = ["parallel.ep=2"]
R3 = ["rollout.routing_replay=r3"]
RUNS = {  # family -> its layout and replay overrides
    "qwen3_5_moe": EP2,
    "qwen3_next": ["parallel.tp=2", "parallel.etp=1", *EP2],  # Gated DeltaNet heads split over TP
    "deepseek_v32": [*EP2, *R3],
    "glm_moe_dsa": [*EP2, *R3],
    "minimax_m2": EP2,
}
# token rows scored on the export (byte ids of the demo tokenizer), all longer than the tiny index_topk (6)
ROWS = [list(range(40, 40 + n)) for n in (9, 17, 30)] + [[7 * i % 250 + 3 for i in range(23)]]


def shortest_prompt(hf_dir: str, rows: int = 64) -> int:
    """Token count of the shortest of the first ``rows`` demo-task prompts (last_digit), as the run
    encodes them with ``hf_dir``'s tokenizer."""
    from gspo_megatron.data.dataset import encode_prompt, format_prompt
    from gspo_megatron.data.tasks import get_task
    from gspo_megatron.data.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    texts = [format_prompt(tok, r["prompt"]) for r in get_task("last_digit").rows(rows, 0)]
    return min(len(encode_prompt(tok, t, bool(tok.chat_template))) for t in texts)


@pytest.mark.parametrize("family", sorted(RUNS))
def test_gspo_train_torchrun_cpu_engine_then_export_loads(family, tmp_path):
    import transformers

    hf_dir = write_demo_tokenized_checkpoint(str(tmp_path / f"tiny-{family}"), family, seed=0)
    hf = json.load(open(os.path.join(hf_dir, "config.json")))
    topk = hf.get("index_topk")
    if topk is not None:  # DSA: every prompt (and so every sequence) is longer than the indexer's top-k
        assert shortest_prompt(hf_dir) > topk and min(map(len, ROWS)) > topk
    out = str(tmp_path / "run")
    model = [f"model.hf_path={hf_dir}", "model.init=pretrained", "model.arch=null"]
    run_train(out, [*ENGINE, *model, *RUNS[family]], nproc=2, timeout=900)

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff"] < 1e-4, (family, r)
        assert r["sync/verify_max_abs_diff"] < 1e-4, (family, r)
        if topk is not None:
            assert "rollout/indexer_agreement" in r, r  # the engine returned its selection; the trainer replayed it

    export = os.path.join(out, "hf_final")
    lm = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(lm).__name__ == hf["architectures"][0]
    exported = hf_logprobs(lm, ROWS)
    trainer = score_checkpoint(os.path.join(out, "checkpoints"), ROWS, str(tmp_path / "score"))
    assert max_abs_diff(exported, trainer) < 1e-4, family
    initial = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert max_abs_diff(hf_logprobs(initial, ROWS), exported) > 1e-3, family  # the run trained
