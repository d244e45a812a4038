"""The built-in tool-calling example: the policy may call a calculator, reads its answer, and answers.

Task ``tool_calc`` (rows from :data:`gspo_megatron.data.tasks.TASKS`): "7+8=?" -> "15" (single-digit
operands, + or *). Rollout hook :func:`tool_calc_rollout` (``rollout.custom_function:
gspo_megatron.data.tool_calc:tool_calc_rollout``), two turns at most, in the chat template::

    <|im_start|>user\\n7+8=?<|im_end|>\\n<|im_start|>assistant\\n          prompt
    7+8=                                                                 policy: a calculator call (trained)
    <|im_end|>\\n<|im_start|>tool\\n15<|im_end|>\\n<|im_start|>assistant\\n  tool output (not trained)
    15<|im_end|>                                                         policy: the answer (trained)

A first turn ending in ``=`` (a stop token of that turn) calls the calculator on the expression
before it, or on the question's expression when the turn is just ``=`` (so the tiny demo model only
has to learn *when* to call the tool and to copy its result; a larger model writes the expression).
A first turn ending otherwise is the answer. The tool output is tokenized with the run's tokenizer; the policy's tokens are exactly the
engine's.

Reward in [0, 1]: ``TOOL_CREDIT * [a calculator call that evaluates] + (1 - TOOL_CREDIT) *
shaped_integer_reward(answer, label)`` (see :func:`gspo_megatron.data.answer_reward.shaped_integer_reward`).
Metrics: ``custom/tool_calls`` (share of samples calling the tool), ``custom/tool_errors``,
``custom/correct``.
"""

from __future__ import annotations

import ast
import operator
import random

TOOL_CREDIT = 0.2  # for a well-formed calculator call; the answer's correctness carries the rest
CALL_SUFFIX = "="  # ends a calculator call (a stop token of the first turn)
TURN_TOKENS = 4  # max new tokens per policy turn
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an integer expression of + - * and parentheses (no names, no calls, at most 64
    characters, |values| < 10**12); returns the result as text, or ``error``."""
    if len(expression) > 64:
        return "error"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return "error"

    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(value) >= 10**12:
                raise ValueError("too large")
            return value
        raise ValueError("unsupported")

    try:
        return str(ev(tree))
    except (ValueError, RecursionError):
        return "error"


def make_row(rng: random.Random) -> dict:
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+*")
    return {"prompt": f"{a}{op}{b}=?", "label": str(a + b if op == "+" else a * b)}


def question_expression(prompt: str) -> str:
    return prompt.split("=", 1)[0]


def tool_turn_ids(tokenizer, result: str) -> list[int]:
    """The end of the policy's call turn, the tool's turn and the next assistant header:
    ``<|im_end|>\\n<|im_start|>tool\\n{result}<|im_end|>\\n<|im_start|>assistant\\n``."""
    text = f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))


def _turn_text(tokenizer, sample) -> str:
    ids = sample.response_ids[:-1] if sample.finish_reason == "stop" else sample.response_ids
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def tool_calc_rollout(generate, sample) -> dict:
    """The rollout hook (see the module docstring); ``sample`` is a
    :class:`gspo_megatron.engines.custom.HookSample`."""
    from gspo_megatron.data.answer_reward import shaped_integer_reward
    from gspo_megatron.engines.custom import Trajectory

    tok = sample.tokenizer
    traj = Trajectory()
    turn = min(TURN_TOKENS, sample.max_response_tokens)
    call_id = tok.encode(CALL_SUFFIX, add_special_tokens=False)
    stops = list(sample.params.stop_token_ids) + (call_id if len(call_id) == 1 else [])
    first = generate(sample.prompt_ids, max_new_tokens=turn, stop_token_ids=stops)
    traj.add_policy(first)
    called = first.finish_reason == "stop" and first.response_ids[-1:] == call_id
    answer = _turn_text(tok, first)
    metrics = {"tool_calls": float(called), "tool_errors": 0.0}
    good_call = False
    if called:
        expression = answer.strip() or question_expression(sample.prompt)
        result = calculator(expression)
        good_call = result != "error"
        metrics["tool_errors"] = float(not good_call)
        env = tool_turn_ids(tok, result)
        budget = sample.max_response_tokens - len(traj) - len(env)
        if budget >= 1:
            traj.add_env(env)
            second = generate(list(sample.prompt_ids) + traj.response_ids, max_new_tokens=min(turn, budget))
            traj.add_policy(second)
            answer = _turn_text(tok, second)
        else:
            answer = ""
    score = shaped_integer_reward(answer, str(sample.label))
    metrics["correct"] = float(answer.strip() == str(sample.label))
    return traj.result(reward=TOOL_CREDIT * good_call + (1 - TOOL_CREDIT) * score, metrics=metrics)


def single_turn_reward(prompt: str, response: str, label: object) -> float:
    """The task's reward for a plain (single-turn) response: the answer's shaped reward scaled as in
    the hook (no tool call, so no tool credit)."""
    from gspo_megatron.data.answer_reward import shaped_integer_reward

    return (1 - TOOL_CREDIT) * shaped_integer_reward(response, str(label))
