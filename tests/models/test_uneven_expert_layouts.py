"""TP2 x EP2 with expert-tensor parallel size 2 (= TP, the default) and 1, on gloo, with uneven
expert loads: the scorer's log-probs and one GSPO training step (loss, grad norm, two optimizer
steps) equal the single-rank run.

With ETP > 1 the alltoall dispatcher all-gathers, over the TP group, the tokens each TP rank routes
to this rank's experts: uneven counts, which gloo's all-gather refuses unless the CPU layer pads
them (runtime/cpu_compat.py). The workers record every split list the dispatcher passes, and the
tests assert that uneven ones occurred (the padded path really ran), on every rank.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.sample import Sample
from hf_reference import hf_logprobs, make_rows, max_abs_diff
from uneven_expert_workers import score_and_train

ROWS = make_rows(seed=3, n=7)
OVERRIDES = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "parallel.micro_batch_size=2",
    "gspo.mini_batches=2",
    "optimizer.lr=0.003",
]
ETP2, ETP1, PP2 = dict(tp=2, ep=2), dict(tp=2, ep=2, etp=1), dict(tp=2, ep=2, pp=2)


def make_records(n: int = 8, seed: int = 5) -> list[Sample]:
    """GSPO training Samples: random tokens (uneven routing), prompt lengths, engine log-probs and
    advantages, as the rollout produces them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        prompt = int(torch.randint(2, length - 1, (1,), generator=g))
        out.append(
            Sample.from_tokens(
                torch.randint(0, 256, (length,), generator=g).tolist(),
                prompt,
                engine_logprobs=(-3 * torch.rand(length - prompt, generator=g)).tolist(),
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir = str(tmp_path_factory.mktemp("uneven") / "hf")
    model = save_tiny_hf_model("qwen3_moe", hf_dir, seed=11)
    return hf_dir, hf_logprobs(model.float(), ROWS)


def run(hf_dir, layouts, world):
    return run_ranks(score_and_train, world, hf_dir, layouts, ROWS, make_records(), OVERRIDES)[0]


@pytest.fixture(scope="module")
def single(hf_model):
    return run(hf_model[0], [dict()], 1)["tp1"]


@pytest.fixture(scope="module")
def four_ranks(hf_model):
    return run(hf_model[0], [ETP2, ETP1], 4)


def assert_matches(result, single, hf_ref):
    assert max_abs_diff(result["logprobs"], single["logprobs"]) < 1e-5
    assert max_abs_diff(result["logprobs"], hf_ref) < 1e-4  # and transformers' own forward
    for key in ("loss/total", "train/grad_norm", "gspo/ratio_mean"):
        assert result["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-7), key
    assert result["metrics"]["train/skipped_updates"] == 0


def assert_uneven_on_every_rank(result, ranks):
    for r in ranks:
        splits = result["splits"][r]
        assert splits, f"rank {r}: the dispatcher never gathered with split sizes"
        assert any(len(set(s)) > 1 for s in splits), f"rank {r}: expert loads were even: {splits}"


def test_single_rank_trains(single, hf_model):
    assert max_abs_diff(single["logprobs"], hf_model[1]) < 1e-4
    assert single["splits"] == [[]]  # no TP group: no split gather
    assert single["metrics"]["train/grad_norm"] > 0


def test_tp2_ep2_etp2_uneven_loads_match_single_rank(four_ranks, single, hf_model):
    result = four_ranks["ep2+tp2"]
    assert_uneven_on_every_rank(result, range(4))
    assert_matches(result, single, hf_model[1])


def test_tp2_ep2_etp1_matches_single_rank(four_ranks, single, hf_model):
    result = four_ranks["ep2+etp1+tp2"]
    # ETP1: the experts are not split over TP, the dispatcher exchanges tokens by all-to-all only
    assert all(s == [] for s in result["splits"])
    assert_matches(result, single, hf_model[1])


@pytest.mark.slow
def test_tp2_ep2_etp2_pp2_matches_single_rank(hf_model, single):
    result = run(hf_model[0], [PP2], 8)["ep2+pp2+tp2"]
    # ranks 0-3 hold the first pipeline stage (its MoE layers); 4-7 the last
    assert_uneven_on_every_rank(result, range(8))
    assert_matches(result, single, hf_model[1])


def test_uneven_split_collectives_match_reference():
    """The padded gloo collectives against the definition: gather = concatenation of every rank's
    rows; its backward and the split reduce-scatter = sum over ranks of this rank's slice."""
    from uneven_expert_workers import uneven_collectives

    sizes = [3, 0, 5]
    results = run_ranks(uneven_collectives, 3, sizes)
    inputs = [torch.arange(n * 3, dtype=torch.float64).reshape(-1, 3) + 100 * r for r, n in enumerate(sizes)]
    offsets = [0, 3, 3, 8]
    shape = (sum(sizes), 3)
    for r, res in enumerate(results):
        assert torch.equal(res["gathered"], torch.cat(inputs))
        weight_sum = torch.arange(24, dtype=torch.float64).reshape(shape) * sum(k + 1 for k in range(3))
        assert torch.equal(res["grad"], weight_sum[offsets[r] : offsets[r + 1]])
        full = (torch.arange(24, dtype=torch.float64).reshape(shape) + 7) * sum(k + 1 for k in range(3))
        assert torch.equal(res["scattered"], full[offsets[r] : offsets[r + 1]])
