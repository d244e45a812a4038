"""Custom rollout hooks (rollout.custom_function): loss mask, sampled ids kept, batching, bad input.

A real transformers engine (tiny Qwen3-MoE, the byte-level demo tokenizer) generates; a recording
wrapper keeps every engine call, so the records can be checked against what the engine sampled.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from transformers import Qwen3MoeConfig

from gspo_megatron.config import Config
from gspo_megatron.data.dataset import PromptDataset, PromptSampler
from gspo_megatron.data.tasks import get_task
from gspo_megatron.data.tokenizer import build_demo_tokenizer
from gspo_megatron.engines.custom import load_hook
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.errors import ConfigError, UserInputError
from gspo_megatron.orchestration.batch import collect_rollouts
from gspo_megatron.rewards.runner import InlineRewardScorer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL_HOOK = "gspo_megatron.data.tool_calc:tool_calc_rollout"


class RecordingEngine:
    """Forwards to an engine and keeps (prompt ids, sampled ids, log-probs) of every sample."""

    def __init__(self, engine):
        self.engine, self.calls, self.engine_calls = engine, [], 0

    def generate(self, prompts, n, params):
        self.engine_calls += 1
        out = self.engine.generate(prompts, n, params)
        for p, group in zip(prompts, out):
            for s in group:
                self.calls.append((list(p), list(s.response_ids), list(s.response_logprobs)))
        return out

    def generate_stream(self, prompts, n, params):
        yield list(enumerate(self.generate(prompts, n, params)))


# the tiny Qwen3-MoE the hook tests sample from (here and in test_custom_rollout_engines.py; transformers'
# defaults for the rest, unlike the families' tiny configs)
ENGINE_CONFIG = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return HFRolloutEngine(Qwen3MoeConfig(**ENGINE_CONFIG), seed=3)


class ScriptedEngine:
    """A stand-in policy for the tool example: sample k of a call calls the calculator ("=") when k
    is even, else answers "7"; second turns answer "56". Log-probs are distinct per call."""

    def __init__(self, tokenizer):
        self.tok, self.n = tokenizer, 0

    def generate(self, prompts, n, params):
        from gspo_megatron.engines.base import RolloutSample

        out = []
        for p in prompts:
            second = self.tok.decode(p).endswith("tool\n" + "") or "<|im_start|>tool" in self.tok.decode(p)
            self.n += 1
            text = "56" if second else ("=" if self.n % 2 == 0 else "7")
            ids = self.tok.encode(text, add_special_tokens=False)
            if text != "=":
                ids.append(self.tok.eos_token_id)
            out.append([RolloutSample(list(p), ids, [-0.01 * self.n - 0.001 * j for j in range(len(ids))], "stop")])
        return out


def _cfg(hook, **rollout):
    cfg = Config()
    cfg.rollout.custom_function = hook
    cfg.rollout.group_size = 4
    cfg.rollout.prompts_per_step = 6
    cfg.rollout.max_new_tokens = 4
    cfg.data.task = "tool_calc"
    cfg.reward.function = "tool_calc"
    cfg.model.max_seq_len = 128
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def _collect(cfg, engine, tokenizer, step=1):
    rows = get_task(cfg.data.task).rows(64, seed=0)
    ds = PromptDataset.from_records(rows, tokenizer, source="task tool_calc", max_prompt_tokens=32)
    sampler = PromptSampler(len(ds), seed=0)
    return collect_rollouts(cfg, step, engine, ds, sampler, tokenizer, InlineRewardScorer(cfg.reward.function))


def _forced_calls_hook(tmp_path, tokenizer):
    """A 3-turn hook: every turn is followed by a fixed 'user' turn, so every record mixes policy and
    non-policy tokens whatever the policy samples."""
    path = tmp_path / "three_turns.py"
    path.write_text(
        textwrap.dedent("""
        from gspo_megatron.engines.custom import Trajectory

        def rollout(generate, sample):
            traj = Trajectory()
            for turn in range(3):
                out = generate(sample.prompt_ids + traj.response_ids, max_new_tokens=3)
                traj.add_policy(out)
                traj.add_env(sample.tokenizer.encode("<|im_end|>\\n<|im_start|>user\\nmore<|im_end|>\\n"
                                                     "<|im_start|>assistant\\n", add_special_tokens=False))
            return traj.result(reward=float(len(traj.response_ids) % 3), metrics={"turns": 3})
    """)
    )
    return f"{path}:rollout"


def _expected_mask(record, calls):
    """The loss mask implied by the engine's own calls: the sampled ids of every call whose prompt
    is a prefix of the record, at the position they were sampled; also checks that the record's
    log-probs there are one such call's, bit for bit. Independent of the hook's bookkeeping.
    Returns (mask, [(prompt, ids)] one per turn)."""
    toks, p = record.tokens, record.prompt_len
    turns: dict[int, list] = {}
    for prompt, ids, lps in calls:  # (samples of one group may share a prompt and an output)
        if len(prompt) >= p and toks[: len(prompt)] == prompt and toks[len(prompt) : len(prompt) + len(ids)] == ids:
            turns.setdefault(len(prompt), []).append((prompt, ids, lps))
    mask = [0] * (len(toks) - p)
    for start, cands in sorted(turns.items()):
        ids = cands[0][1]
        k = start - p
        mask[k : k + len(ids)] = [1] * len(ids)
        assert any(record.engine_logprobs[k : k + len(ids)] == lps for _, _, lps in cands)
    return mask, [(c[0][0], c[0][1]) for _, c in sorted(turns.items())]


def test_loss_mask_is_exactly_the_policy_tokens_and_ids_are_the_engines(tmp_path, tokenizer, engine):
    rec_engine = RecordingEngine(engine)
    batch = _collect(_cfg(_forced_calls_hook(tmp_path, tokenizer)), rec_engine, tokenizer)
    assert len(batch.records) == 24
    for rec in batch.records:
        mask, mine = _expected_mask(rec, rec_engine.calls)
        assert len(mine) == 3  # three turns, each sampled by the engine
        assert rec.loss_mask == mask
        assert 0 < sum(mask) < len(mask)  # the user turns are there and not trained
        assert all(lp == 0.0 for m, lp in zip(mask, rec.engine_logprobs) if not m)
    assert batch.metrics["custom/turns"] == 3.0
    assert batch.metrics["rollout/generate_calls_mean"] == 3.0
    # 24 samples x 3 turns went to the engine in 3 batched calls (one per turn), not 72
    assert rec_engine.engine_calls == 3
    assert all(r.metrics == {} for r in batch.records)  # averaged above, not broadcast
    assert [r.generate_calls for r in batch.records] == [3] * 24


def test_tool_example_masks_tool_output_and_keeps_sampled_ids(tokenizer):
    rec_engine = RecordingEngine(ScriptedEngine(tokenizer))
    batch = _collect(_cfg(TOOL_HOOK), rec_engine, tokenizer)
    called = 0
    for rec in batch.records:
        mask, mine = _expected_mask(rec, rec_engine.calls)
        assert rec.loss_mask == mask
        if len(mine) == 2:  # a calculator call: the tool turn sits between the two policy turns
            called += 1
            from gspo_megatron.data.tool_calc import calculator, tool_turn_ids

            first_end = len(mine[0][0]) + len(mine[0][1])
            expr = tokenizer.decode(mine[0][1][:-1]) or rec_prompt_expr(tokenizer, rec)  # "=" alone
            env = tool_turn_ids(tokenizer, calculator(expr))
            assert rec.tokens[first_end : first_end + len(env)] == env
            assert mask[first_end - rec.prompt_len : first_end - rec.prompt_len + len(env)] == [0] * len(env)
    assert called == batch.metrics["custom/tool_calls"] * len(batch.records) > 0
    assert batch.metrics["custom/tool_errors"] == 0.0
    from gspo_megatron.data.answer_reward import shaped_integer_reward
    from gspo_megatron.data.tool_calc import calculator

    for rec in batch.records:  # with a call: 0.2 + 0.8 * shaped("56"), else 0.8 * shaped("7")
        label = calculator(rec_prompt_expr(tokenizer, rec))
        text = tokenizer.decode(rec.tokens[rec.prompt_len :])
        if "<|im_start|>tool" in text:
            assert rec.reward == pytest.approx(0.2 + 0.8 * shaped_integer_reward("56", label))
        else:
            assert rec.reward == pytest.approx(0.8 * shaped_integer_reward("7", label))


def rec_prompt_expr(tokenizer, rec):
    text = tokenizer.decode(rec.tokens[: rec.prompt_len])
    return text.split("user\n", 1)[1].split("=", 1)[0]


@pytest.mark.parametrize(
    "change, words",
    [
        ("ids = ids[:1] + [(ids[1] + 1) % 256] + ids[2:]", "trained token 1 (response_ids[1] = "),  # one id changed
        (
            "ids = sample.tokenizer.encode('x' + sample.tokenizer.decode(ids), add_special_tokens=False)",
            "trained tokens from response_ids[0] on were not sampled",
        ),  # text edited and re-encoded
    ],
)
def test_changed_policy_ids_are_refused(tmp_path, tokenizer, engine, change, words):
    path = tmp_path / "retok.py"
    path.write_text(
        textwrap.dedent(f"""
        def rollout(generate, sample):
            ids = list(generate(sample.prompt_ids, max_new_tokens=4, stop_token_ids=[]).response_ids)
            {change}
            return {{"response_ids": ids, "loss_mask": [1] * len(ids), "reward": 1.0}}
    """)
    )
    with pytest.raises(UserInputError) as e:
        _collect(_cfg(f"{path}:rollout"), RecordingEngine(engine), tokenizer)
    msg = str(e.value)
    assert msg.startswith("rollout.custom_function") and words in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "body, words",
    [
        ("return [1, 2]", "returned list, expected a dict"),
        ("return {'response_ids': out.response_ids, 'loss_mask': [1], 'reward': 1.0}", "loss_mask has 1 entries"),
        ("return {'response_ids': out.response_ids, 'reward': 1.0}", "without ['loss_mask']"),
        (
            "return {'response_ids': out.response_ids, 'loss_mask': [1] * len(out.response_ids), 'reward': 'high'}",
            "reward must be a finite number",
        ),
        (
            "return {'response_ids': out.response_ids, 'loss_mask': [1] * len(out.response_ids), 'logprobs': [0.5]}",
            "logprobs has 1 entries",
        ),
        ("return {'response_ids': [7] * 200, 'loss_mask': [0] * 200}", "exceed the budget"),
        ("raise KeyError('oops')", "raised on task tool_calc row"),
    ],
)
def test_wrong_return_shape_one_line_naming_the_field(tmp_path, tokenizer, engine, body, words):
    path = tmp_path / "bad.py"
    path.write_text(f"def rollout(generate, sample):\n    out = generate(sample.prompt_ids)\n    {body}\n")
    with pytest.raises(UserInputError) as e:
        _collect(_cfg(f"{path}:rollout"), engine, tokenizer)
    msg = str(e.value)
    assert msg.startswith("rollout.custom_function") and words in msg and "\n" not in msg, msg
    if "raise" in body:
        assert f"{path}:3" in msg  # the user's file and line


def test_missing_file_and_wrong_signature(tmp_path):
    from gspo_megatron.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"rollout.custom_function={tmp_path}/nope.py:rollout"])
    assert str(e.value) == f"rollout.custom_function: file '{tmp_path}/nope.py' does not exist"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.custom_function=nocolon"])
    assert str(e.value).startswith("rollout.custom_function 'nocolon' must be")
    with pytest.raises(UserInputError) as e:
        load_hook(f"{tmp_path}/nope.py:rollout")
    assert "rollout.custom_function: file" in str(e.value)
    bad = tmp_path / "sig.py"
    bad.write_text("def rollout(sample):\n    return {}\n\ndef syntax(:\n")
    with pytest.raises(UserInputError) as e:
        load_hook(f"{bad}:rollout")
    assert "syntax error at" in str(e.value) and f"{bad}:4" in str(e.value)
    bad.write_text("def rollout(sample):\n    return {}\n")
    with pytest.raises(UserInputError) as e:
        load_hook(f"{bad}:rollout")
    msg = str(e.value)
    assert msg.startswith("rollout.custom_function") and "fn(generate, sample)" in msg and "\n" not in msg
    with pytest.raises(UserInputError) as e:
        load_hook(f"{bad}:other")
    assert "has no attribute 'other'" in str(e.value)


def test_gspo_train_check_one_line_for_bad_hook_return(tmp_path):
    """``gspo-train --check`` calls the hook once (stand-in engine) and stops with one line, exit 2."""
    bad = tmp_path / "hook.py"
    bad.write_text(
        "def rollout(generate, sample):\n    out = generate(sample.prompt_ids)\n"
        "    return {'response_ids': out.response_ids, 'loss_mask': []}\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gspo_megatron.train",
            "--config",
            "configs/tool_calc_cpu.yaml",
            "--check",
            f"output_dir={tmp_path}/run",
            f"rollout.custom_function={bad}:rollout",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("gspo-train: error: rollout.custom_function"), proc.stderr
    assert "loss_mask has 0 entries for 1 response_ids" in lines[-1]


def test_check_accepts_the_tool_example(tmp_path, tokenizer):
    from gspo_megatron.data.dataset import PromptDataset
    from gspo_megatron.engines.custom import dry_run

    ds = PromptDataset.from_records(get_task("tool_calc").rows(2, 0), tokenizer, source="t")
    dry_run(TOOL_HOOK, ds[0], tokenizer, 64, tokenizer.eos_token_id)  # no error
