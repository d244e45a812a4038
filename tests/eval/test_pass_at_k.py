"""pass@k (the unbiased estimator) against a brute-force count over every k-subset of fixed samples,
the evaluation schedule, and an eval set's metrics computed from fixed samples."""

import itertools
import random
from fractions import Fraction

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.data.dataset import PromptDataset
from gspo_megatron.engines.base import RolloutSample
from gspo_megatron.evaluation import EvalSet, Evaluator, is_due, pass_at_k
from gspo_megatron.rewards.runner import InlineRewardScorer


def brute_force_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """Share of the k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


# fixed samples: per prompt, which of its n = 6 samples are correct
FIXED = [
    [False] * 6,
    [True, False, False, False, False, False],
    [False, True, False, True, False, False],
    [True, True, False, True, False, True],
    [True] * 6,
    [False, False, False, False, True, True],
]


@pytest.mark.parametrize("k", range(1, 7))
def test_pass_at_k_equals_the_brute_force_count_over_subsets(k):
    for correct in FIXED:
        want = brute_force_pass_at_k(correct, k)
        assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(float(want), abs=1e-12), (correct, k)


def test_pass_at_k_random_sets_and_edges():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        correct = [rng.random() < 0.3 for _ in range(n)]
        k = rng.randint(1, n)
        assert pass_at_k(n, sum(correct), k) == pytest.approx(float(brute_force_pass_at_k(correct, k)), abs=1e-12)
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the share of correct samples
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_schedule_step_zero_every_interval_and_the_last():
    assert [s for s in range(0, 11) if is_due(s, 3, 10)] == [0, 3, 6, 9, 10]
    assert [s for s in range(0, 11) if is_due(s, 5, 10)] == [0, 5, 10]
    assert not any(is_due(s, 0, 10) for s in range(11))


class FixedEngine:
    """Answers prompt i's sample j with the text FIXED_TEXT[i][j] (token ids = bytes), for the metric
    reduction only."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []

    def generate(self, prompts, n, params):
        self.calls.append((len(prompts), n, params))
        out = []
        for p in prompts:
            i = self.prompt_index[tuple(p)]
            ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in self.texts[i][:n]]
            out.append([RolloutSample(list(p), r, [0.0] * len(r), "length") for r in ids])
        return out


def test_eval_set_metrics_from_fixed_samples(tmp_path):
    from gspo_megatron.data.tokenizer import build_demo_tokenizer, load_tokenizer

    build_demo_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    n = 6
    cfg = load_config(
        None,
        [
            "eval.interval=1",
            "eval.datasets=[task:last_digit]",
            f"eval.n={n}",
            "eval.pass_k=[1,2,5]",
            "eval.greedy=false",
            "rollout.prompts_per_step=4",
            "reward.function=exact_match",
            "data.apply_chat_template=false",
        ],
    )
    rows = [{"prompt": f"question {i}", "label": f"a{i}"} for i in range(len(FIXED))]
    ds = PromptDataset.from_records(rows, tok, use_chat_template=False)
    texts = [[f"a{i}" if c else "wrong" for c in correct] for i, correct in enumerate(FIXED)]
    engine = FixedEngine(tok, texts)
    engine.prompt_index = {tuple(r.prompt_ids): i for i, r in enumerate(ds.rows)}
    ev = Evaluator(cfg, tok, engine, InlineRewardScorer("exact_match"))
    ev.sets = [EvalSet("fixed", ds)]
    m = ev.collect(step=3).metrics
    flat = [c for correct in FIXED for c in correct]
    assert m["eval/fixed/mean_reward"] == pytest.approx(sum(flat) / len(flat))
    for k in (1, 2, 5):
        want = sum(float(brute_force_pass_at_k(c, k)) for c in FIXED) / len(FIXED)
        assert m[f"eval/fixed/pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert m["eval/fixed/reward_failures"] == 0.0
    assert m["eval/fixed/response_len_mean"] == pytest.approx(
        sum(len(tok.encode(t, add_special_tokens=False)) for ts in texts for t in ts) / len(flat)
    )
    # prompts go in chunks of rollout.prompts_per_step, eval.n samples each, sampled at eval.temperature
    assert [(c[0], c[1]) for c in engine.calls] == [(4, n), (2, n)]
    assert engine.calls[0][2].top_k == cfg.rollout.top_k and engine.calls[0][2].temperature == cfg.eval.temperature
    cfg.eval.greedy = True
    ev.collect(step=4)
    assert engine.calls[-1][2].top_k == 1


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["eval.interval=-1"], "eval.interval must be >= 0"),
        (["eval.interval=2"], "eval.interval=2 needs eval.datasets"),
        (["eval.n=4", "eval.pass_k=[1,8]"], "eval.pass_k[1]=8 must be in [1, eval.n=4]"),
        (["eval.n=0"], "eval.n must be >= 1"),
        (["eval.datasets=[x=data.csv]"], "eval.datasets[0] 'x=data.csv': the file must end in .jsonl or .parquet"),
        (["eval.datasets=[task:last_digit,task:last_digit]"], "the name 'last_digit' is used twice"),
        (["eval.datasets=[task:nope]"], "'nope' is not a built-in task"),
        (["eval.temperature=0"], "eval.temperature must be > 0"),
        (["reward.url=localhost:8000"], "reward.url must be an http:// or https:// URL with a host"),
        (["reward.url=http://"], "reward.url must be an http:// or https:// URL with a host"),
        (["reward.url=http://127.0.0.1:99999/score"], "reward.url has a bad port"),
        (["reward.batch_size=0"], "reward.batch_size must be >= 1"),
        (["reward.max_in_flight=0"], "reward.max_in_flight must be >= 1"),
        (["reward.retries=-1"], "reward.retries must be >= 0"),
    ],
)
def test_bad_eval_and_remote_reward_keys_name_the_field(overrides, field):
    from gspo_megatron.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value)


def test_missing_eval_file_is_named_before_start(tmp_path):
    from gspo_megatron.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval.datasets\[0\] 'held=.*nope.jsonl': file .* does not exist"):
        load_config(None, [f"eval.datasets=[held={tmp_path}/nope.jsonl]", "eval.interval=1"])
