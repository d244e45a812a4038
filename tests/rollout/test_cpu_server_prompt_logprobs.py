"""Prompt log-probs of the CPU server's ``/generate`` as sglang 0.5.23 answers them (teacher scoring:
``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len``; ``gspo_megatron/cpu_server/prompt_logprobs.py``).

One tp-1 engine (the tiny qwen3_moe, fp32) for the module; the reference is transformers' own forward of
the same checkpoint in fp32: ``log_softmax(logits)`` at position i - 1 gathered at token i. sglang's
layout: entries for input positions ``L .. n-1``, entry 0 ``None`` (for every L), entry j the log-prob of
token ``L + j``; ``[logprob, token_id, text]`` with text null without a tokenizer. A second, short-lived
engine checks that a negative start sglang's scheduler asserts on ends the server.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from cpu_server_util import CpuServer
from gspo_megatron.cpu_server import prompt_logprobs as plp
from gspo_megatron.cpu_server.sglang_runtime import SchedulerDeath

# (prompt, response): different lengths; the teacher scores prompt + response
SEQS = [([5, 17, 42, 9], [100, 3, 77]), ([100, 3], [8, 9, 10, 11, 12]), ([1, 2, 3, 4, 5, 6], [200])]
ATOL = 1e-5


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = CpuServer(model_dir, str(tmp_path_factory.mktemp("logs")), tp=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(ids):
        """[n, V]: row p is log_softmax of the logits at position p (the distribution of token p + 1)."""
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([list(ids)])).logits[0].float(), -1)

    return logp


def post(url, body, timeout=120):
    req = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        try:
            status, raw = e.code, e.read()
        except http.client.IncompleteRead as cut:  # a server that exits right after answering
            status, raw = e.code, cut.partial
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def score(url, ids, start, top=0, **extra):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
        "return_logprob": True,
        "logprob_start_len": start,
        **({"top_logprobs_num": top} if top else {}),
        **extra,
    }
    status, out = post(url, body)
    assert status == 200, out
    return out


def check_entries(entries, ids, start, logp):
    """sglang's layout and values of ``input_token_logprobs`` from ``start``."""
    assert len(entries) == len(ids) - start
    assert entries[0] == [None, ids[start], None]
    for j, (v, tok, text) in enumerate(entries[1:], start=1):
        pos = start + j
        assert tok == ids[pos] and text is None
        assert abs(v - float(logp[pos - 1, ids[pos]])) < ATOL, (pos, v, float(logp[pos - 1, ids[pos]]))


def test_teacher_scoring_batch_from_the_response_start(server, ref):
    """A batch of prompt + response, ``logprob_start_len`` the prompt's length per input: prefill only,
    no output token, one entry per response token (the first None), full-precision values, no
    temperature (the request's 0.7 is not applied to prompt log-probs)."""
    batch = [p + r for p, r in SEQS]
    status, outs = post(
        server.url,
        {
            "input_ids": batch,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
            "return_logprob": True,
            "logprob_start_len": [len(p) for p, _ in SEQS],
        },
    )
    assert status == 200, outs
    assert len(outs) == len(SEQS)
    for (p, r), ids, out in zip(SEQS, batch, outs):
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["prompt_tokens"] == len(ids)
        assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
        assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
        check_entries(meta["input_token_logprobs"], ids, len(p), ref(ids))
    # every response token's log-prob: start one earlier and drop the None entry
    for p, r in SEQS:
        ids = p + r
        entries = score(server.url, ids, len(p) - 1)["meta_info"]["input_token_logprobs"]
        logp = ref(ids)
        assert [e[1] for e in entries[1:]] == r
        want = torch.tensor([float(logp[len(p) - 1 + j, t]) for j, t in enumerate(r)])
        assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), want, atol=ATOL, rtol=0)


def test_start_zero_and_negative_starts_at_least_the_input_length(server, ref):
    ids = SEQS[0][0] + SEQS[0][1]
    entries = score(server.url, ids, 0)["meta_info"]["input_token_logprobs"]
    check_entries(entries, ids, 0, ref(ids))
    # sglang computes from position 0 and answers ids origin_input_ids[L:]: -L >= n is start 0
    assert score(server.url, ids, -len(ids))["meta_info"]["input_token_logprobs"] == entries
    assert score(server.url, ids, -100)["meta_info"]["input_token_logprobs"] == entries


def test_top_logprobs(server, ref):
    """``input_top_logprobs``: None, then per position the top-k of the same log-softmax (torch.topk,
    largest first); prefill only, ``output_top_logprobs`` holds one row: the last position's top-k."""
    ids, start, k = SEQS[1][0] + SEQS[1][1], 1, 5
    meta = score(server.url, ids, start, top=k, return_text_in_logprobs=True)["meta_info"]
    logp = ref(ids)
    rows = meta["input_top_logprobs"]
    assert len(rows) == len(ids) - start and rows[0] is None
    for j, row in enumerate(rows[1:], start=1):
        v, i = torch.topk(logp[start + j - 1], k)
        assert [e[1] for e in row] == i.tolist()
        assert torch.allclose(torch.tensor([e[0] for e in row]), v, atol=ATOL, rtol=0)
        assert all(e[2] is None for e in row)  # no tokenizer in the checkpoint: sglang's skip_tokenizer_init
    check_entries(meta["input_token_logprobs"], ids, start, logp)
    assert meta["output_token_logprobs"] == []
    (last,) = meta["output_top_logprobs"]
    v, i = torch.topk(logp[-1], k)
    assert [e[1] for e in last] == i.tolist()
    assert torch.allclose(torch.tensor([e[0] for e in last]), v, atol=ATOL, rtol=0)
    # top_logprobs_num <= 0: no top log-probs at all
    meta = score(server.url, ids, start, top=-3)["meta_info"]
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


def test_generation_keeps_its_output_logprobs(server, ref):
    """With generated tokens: prompt log-probs from the start, output log-probs and top rows as before
    (greedy: log_softmax(logits); sampled: log_softmax(logits / T))."""
    prompt, start, k = SEQS[0][0], 2, 3
    for sp, t in (({"temperature": 0.0, "max_new_tokens": 4}, 1.0), ({"temperature": 0.6, "max_new_tokens": 3}, 0.6)):
        status, out = post(
            server.url,
            {
                "input_ids": prompt,
                "sampling_params": {**sp, "ignore_eos": True},
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": k,
            },
        )
        assert status == 200, out
        meta, gen = out["meta_info"], out["output_ids"]
        assert len(gen) == sp["max_new_tokens"] == meta["output_token_logprobs_length"]
        full = ref(prompt + gen)
        check_entries(meta["input_token_logprobs"], prompt, start, full)
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt) - start
        scaled = torch.log_softmax(torch.log_softmax(full, -1) / t, -1)  # log_softmax(logits / T)
        for j, (e, row) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
            pos = len(prompt) - 1 + j
            assert e[1] == gen[j] and e[2] is None
            assert abs(e[0] - float(scaled[pos, gen[j]])) < ATOL
            v, i = torch.topk(scaled[pos], k)
            assert [x[1] for x in row] == i.tolist()
            assert torch.allclose(torch.tensor([x[0] for x in row]), v, atol=ATOL, rtol=0)


def test_defaults_and_ignored_fields(server):
    ids = SEQS[0][0]
    # logprob_start_len -1 (default) and L == n: no prompt log-probs
    assert score(server.url, ids, -1)["meta_info"]["input_token_logprobs"] == []
    meta = score(server.url, ids, len(ids), top=2)["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    # return_logprob false: logprob_start_len (even past the input) and top_logprobs_num are ignored
    status, out = post(
        server.url,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "logprob_start_len": 99,
            "top_logprobs_num": 4,
        },
    )
    assert status == 200, out
    assert not any("logprob" in key for key in out["meta_info"]), out["meta_info"]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_zero_tokens_in_a_batch_that_generates(server, ref):
    """Not prefill-only (another input generates): the max_new_tokens 0 input's token is sampled and its
    log-prob answered, its output_ids stay empty (sglang's finished_len 0, ``max(len(output_ids), 1)``)."""
    a, b = SEQS[0][0], SEQS[1][0]
    status, outs = post(
        server.url,
        {
            "input_ids": [a, b],
            "sampling_params": [{"max_new_tokens": 0, "temperature": 0}, {"max_new_tokens": 2, "temperature": 0}],
            "return_logprob": True,
            "logprob_start_len": 1,
        },
    )
    assert status == 200, outs
    zero = outs[0]
    assert zero["output_ids"] == [] and zero["meta_info"]["completion_tokens"] == 0
    ((v, tok, _),) = zero["meta_info"]["output_token_logprobs"]
    logp = ref(a)
    assert tok == int(logp[-1].argmax()) and abs(v - float(logp[-1].max())) < ATOL
    check_entries(zero["meta_info"]["input_token_logprobs"], a, 1, logp)
    assert len(outs[1]["output_ids"]) == 2


def test_refusals(server):
    ids = SEQS[0][0]
    base = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    # scheduler.py: a start past the input aborts the request, the tokenizer raises: 400
    msg = (
        "req.logprob_start_len=9 is higher than the number of input tokens len(req.origin_input_ids)=4. "
        "Please use a smaller logprob_start_len."
    )
    assert post(server.url, {**base, "logprob_start_len": 9}) == (400, {"error": {"message": msg}})
    batch = {**base, "input_ids": [ids, ids + [1] * 6], "logprob_start_len": [2, 11]}
    status, out = post(server.url, batch)
    assert status == 400 and "req.logprob_start_len=11 is higher" in out["error"]["message"]
    # the JSON contract (api_contract.py): pydantic coerces these, the contract refuses them
    assert post(server.url, {**base, "logprob_start_len": "2"}) == (
        400,
        {"error": 'invalid type: string "2", expected a value or an array of values for Int64OrList'},
    )
    assert post(server.url, {**base, "top_logprobs_num": True}) == (
        400,
        {"error": "invalid type: boolean `true`, expected a value or an array of values for Int64OrList"},
    )
    assert post(server.url, {**base, "return_text_in_logprobs": 1}) == (
        400,
        {"error": "invalid type: integer `1`, expected a boolean"},
    )
    assert post(server.url, {**base, "input_ids": [ids, ids], "logprob_start_len": [1, 2.0]}) == (
        400,
        {"error": "invalid type: floating point `2.0`, expected i64"},
    )
    # FastAPI's validation of GenerateReqInput first: 422 with pydantic's errors
    status, out = post(server.url, {**base, "logprob_start_len": 2.5})
    assert status == 422
    assert [(e["type"], e["loc"]) for e in out["detail"]] == [
        ("list_type", ["body", "logprob_start_len", "list[int]"]),
        ("int_from_float", ["body", "logprob_start_len", "int"]),
    ]
    # a list shorter than the batch: GenerateReqInput.__getitem__'s IndexError, FastAPI's 500
    assert post(server.url, {**base, "input_ids": [ids, ids], "logprob_start_len": [1]}) == (
        500,
        "Internal Server Error",
    )
    status, out = post(server.url, {**base, "token_ids_logprob": [1, 2]})  # the stand-in's own limit
    assert status == 400 and "not served by the CPU server" in out["error"]["message"]


def test_scheduler_rules_without_a_server():
    """``resolve`` (scheduler.py's rules) and the top-k past the vocabulary sglang's scheduler dies of."""
    assert plp.resolve(False, 99, 5, 4, False) is None
    assert plp.resolve(True, -1, 0, 4, False) == plp.LogprobAsk(4, 0)
    assert plp.resolve(True, 4, 2, 4, False) == plp.LogprobAsk(4, 2)
    assert plp.resolve(True, -4, 0, 4, False) == plp.LogprobAsk(0, 0)
    assert plp.resolve(True, -2, 0, 4, False).death.startswith("AssertionError")
    with pytest.raises(ValueError, match="is higher than the number of input tokens"):
        plp.resolve(True, 5, 0, 4, False)
    with pytest.raises(ValueError, match="not served by the CPU server"):
        plp.resolve(True, 0, 3, 4, True)
    with pytest.raises(SchedulerDeath, match="selected index k out of range"):
        plp.topk(torch.zeros(2, 8), 9)
    # ids >= vocab_size - 1 are answered as 0 (logprob_result_processor.py's clip); the value stays
    out = plp.input_logprobs(torch.zeros(3, 8), [1, 7, 2], plp.LogprobAsk(0, 0))
    assert (
        out["idx"] == [1, 0, 2] and out["val"][0] is None and abs(out["val"][1] + torch.log(torch.tensor(8.0))) < 1e-6
    )


def test_negative_start_sglang_asserts_on_ends_the_server(model_dir, tmp_path):
    """-n < L < -1: sglang's ``add_input_logprob_return_values`` length assert fails in the scheduler,
    which dies with the server; the request gets no answer."""
    s = CpuServer(model_dir, str(tmp_path), tp=1)
    try:
        ids = SEQS[0][0]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        try:
            status, _ = post(s.url, {**body, "logprob_start_len": -2}, timeout=60)
            assert status != 200
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
            pass  # the server went before (or while) answering
        deadline = time.monotonic() + 30
        while s.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.procs[0].poll() is not None, "the CPU server outlived sglang's scheduler assert"
        with open(s.log_path) as f:
            assert "Scheduler hit an exception: AssertionError" in f.read()
    finally:
        s.stop()


def test_answer_layout_and_texts_with_a_tokenizer(tmp_path):
    """``add_logprob_meta`` (tokenizer_manager.py ``add_logprob_to_meta_info``): the keys, the
    ``[logprob, id, text]`` entries, None top rows; texts by the directory's tokenizer under
    ``return_text_in_logprobs`` (``batch_decode`` of each id alone)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(8)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(
        str(tmp_path)
    )
    decode = plp.text_decoder(str(tmp_path), True)
    assert decode([3, 5]) == ["t3", "t5"] and plp.text_decoder(str(tmp_path), False)([3]) == [None]
    out = {
        "output_ids": [3],
        "logprobs": [-0.5],
        "top": [([-0.2, -0.3], [6, 3])],
        "input_logprobs": {
            "val": [None, -1.0],
            "idx": [1, 2],
            "top_val": [None, [-0.1, -0.9]],
            "top_idx": [None, [4, 2]],
        },
    }
    meta: dict = {}
    plp.add_logprob_meta(meta, out, 2, decode)
    assert meta == {
        "input_token_logprobs": [[None, 1, "t1"], [-1.0, 2, "t2"]],
        "output_token_logprobs": [[-0.5, 3, "t3"]],
        "output_token_logprobs_length": 1,
        "input_top_logprobs": [None, [[-0.1, 4, "t4"], [-0.9, 2, "t2"]]],
        "output_top_logprobs": [[[-0.2, 6, "t6"], [-0.3, 3, "t3"]]],
    }
