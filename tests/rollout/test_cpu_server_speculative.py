"""The CPU server's speculative decoding (``cpu_server/speculative.py``): sglang 0.5.23's EAGLE with the
checkpoint's MTP layer as the draft, top-1 chains.

In process (rank 0's decoder on the transformers model of a tiny GLM-4.5 checkpoint with one MTP layer):
- greedy speculative output equals greedy plain output token for token, log-probs the target's;
- the acceptance counts equal a recount from the draft's and the target's argmaxes (full forwards);
- a draft that proposes the target's own argmax is accepted every time (greedy);
- the acceptance rule (sglang's ``TreeSpeculativeSamplingTargetOnly`` with ``draft_probs = 0``) checked
  part by part over grids of its uniforms: acceptance probability q(d), the draw after a rejection q without
  d, the bonus from the last row; so the emitted token is distributed as q;
- sampled speculative decoding's first three tokens against the exact plain distribution (top-k 3).
Through HTTP (one CPU server with ``--speculative-algorithm NEXTN``): the flags as sglang resolves them,
meta_info's spec fields, greedy output equal to the plain engine's, weight updates by ``selector`` reaching
the right runner with sglang's own loaders and the written check, a bad selector refused as sglang does.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.cpu_server.speculative import SpeculativeDecoder, accept_greedy, accept_sampled
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine, _top_k_top_p_filter
from gspo_megatron.engines.mtp_draft import MTPDraft
from mtp_util import write_mtp_checkpoint

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 8, 1, 40], [100, 17]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf dir, config dict, HFRolloutEngine with the checkpoint, its MTP tensors)."""
    d = str(tmp_path_factory.mktemp("glm_mtp"))
    hf, _, mtp = write_mtp_checkpoint(d, "glm4_moe", seed=2)
    engine = HFRolloutEngine(d, d)
    return d, hf, engine, mtp


def _decoder(tiny, steps=3):
    _, hf, engine, mtp = tiny
    model = engine.model
    draft = MTPDraft(hf, mtp, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return SpeculativeDecoder(engine, draft, steps)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def test_transformers_engine_skips_the_mtp_layer(tiny):
    """A weight sync with model.mtp sends model.layers.{N}.*: the transformers engine skips it (as
    sglang's target loader) instead of failing on an unknown name."""
    _, hf, engine, mtp = tiny
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    engine.update_weights(list(mtp.items()))
    assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters())


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_speculative_equals_greedy(tiny, steps):
    _, _, engine, _ = tiny
    dec = _decoder(tiny, steps)
    plain = engine.generate(PROMPTS, 1, GREEDY)
    total_verify = 0
    for prompt, [ref] in zip(PROMPTS, plain):
        out = dec.generate(prompt, GREEDY, torch.Generator().manual_seed(0), frozenset())
        assert out["output_ids"] == ref.response_ids
        torch.testing.assert_close(
            torch.tensor(out["logprobs"]), torch.tensor(ref.response_logprobs), rtol=0, atol=2e-5
        )
        spec = out["spec"]
        total_verify += spec["verify_ct"]
        assert 1 <= spec["verify_ct"] <= len(out["output_ids"]) - 1
        assert 0 <= spec["num_correct_drafts"] <= spec["verify_ct"] * steps
        assert sum(spec["histogram"]) == spec["verify_ct"]
        assert sum(k * c for k, c in enumerate(spec["histogram"])) == spec["num_correct_drafts"]
    assert total_verify > 0


@pytest.mark.parametrize(
    "family, extra",
    [
        ("deepseek_v3", {}),
        ("qwen3_next", {}),
        ("qwen3_5_moe", {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}),
    ],
    ids=["deepseek_v3", "qwen3_next", "qwen3_5_moe_vl"],
)
def test_greedy_speculative_equals_greedy_in_other_families(tmp_path, family, extra):
    """The same on DeepSeek-V3's tiny checkpoint (MLA attention, its own decoder layer in the draft),
    Qwen3-Next's (the ``mtp.*`` branch; a hybrid target whose Gated DeltaNet states cannot be cropped) and
    Qwen3.5-MoE's vision-language checkpoint (the engine serves its language model; the draft is built
    from the text config)."""
    d = str(tmp_path / family)
    hf, _, mtp = write_mtp_checkpoint(d, family, seed=4, **extra)
    engine = HFRolloutEngine(d, d)
    dec = _decoder((d, hf, engine, mtp), 2)
    for prompt, [ref] in zip(PROMPTS, engine.generate(PROMPTS, 1, GREEDY)):
        out = dec.generate(prompt, GREEDY, torch.Generator(), frozenset())
        assert out["output_ids"] == ref.response_ids and out["spec"]["verify_ct"] >= 1


def _recount(engine, draft, prompt, n_out, steps):
    """(verify_ct, accepted drafts) recounted from full forwards: per cycle the draft's argmax chain over the
    target's post-norm hidden states of the committed tokens, against the target's greedy continuation
    (generated past the ``n_out`` output tokens: the engine counts a verify's matches in full, before the
    output is cut at max_new_tokens, as sglang's scheduler does)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=n_out + steps + 1)
    target = list(prompt) + engine.generate([prompt], 1, params)[0][0].response_ids
    seq, verify, correct = target[: len(prompt) + 1], 0, 0
    while len(seq) < len(prompt) + n_out:
        with torch.no_grad():
            h = engine.model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
            hid, ids, drafts = h[:-1], torch.tensor(seq[1:]), []
            for _ in range(steps):
                g, logits = draft(hid, ids, torch.arange(len(ids)))
                d = int(logits[-1].argmax())
                drafts.append(d)
                hid, ids = torch.cat([hid, g[-1:]]), torch.cat([ids, torch.tensor([d])])
        n = 0
        while n < steps and drafts[n] == target[len(seq) + n]:
            n += 1
        verify, correct = verify + 1, correct + n
        seq = target[: len(seq) + n + 1]
    return verify, correct


def test_acceptance_counts_equal_a_recount(tiny):
    _, _, engine, _ = tiny
    dec = _decoder(tiny, 3)
    for prompt in PROMPTS:
        out = dec.generate(prompt, GREEDY, torch.Generator().manual_seed(0), frozenset())
        got = (out["spec"]["verify_ct"], out["spec"]["num_correct_drafts"])
        assert got == _recount(engine, dec.draft, prompt, len(out["output_ids"]), 3)


class OracleDraft:
    """A stand-in draft whose logits are the target's own next-token logits (it re-runs the target on the
    full sequence it is shown): with greedy verification every draft token is accepted."""

    def __init__(self, engine, first_token):
        self.engine, self.first = engine, first_token

    def __call__(self, hidden, ids, pos):
        seq = torch.cat([torch.tensor([self.first]), ids])[None]
        with torch.no_grad():
            logits = self.engine.model(seq).logits[0, 1:]
        return hidden[-1:].expand(len(ids), -1), logits


def test_a_draft_that_is_the_target_is_always_accepted(tiny):
    _, _, engine, _ = tiny
    steps, max_new = 3, 17
    for prompt in PROMPTS:
        dec = SpeculativeDecoder(engine, OracleDraft(engine, prompt[0]), steps)
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
        out = dec.generate(prompt, params, torch.Generator().manual_seed(0), frozenset())
        ref = engine.generate([prompt], 1, params)[0][0].response_ids
        assert out["output_ids"] == ref
        verify = out["spec"]["verify_ct"]
        assert verify == -(-(max_new - 1) // (steps + 1))  # every verify emits steps + 1 tokens
        assert out["spec"]["num_correct_drafts"] == verify * steps


class TokenRecorder:
    """Stands in for ``cpu_server.routes.RouteRecorder`` (GLM-4.5's transformers router is not one the CPU
    server records): each forward's "routes" are the token ids it was fed, so the rows the decoder keeps
    must be the committed tokens in order, sglang's ``[0, seqlen - 1)``."""

    def __init__(self, model):
        self.last = None
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.last = kwargs["input_ids"][0].clone()

    def take(self, batch, seq):
        assert batch == 1 and seq == len(self.last)
        return self.last.view(1, seq, 1, 1)


def test_routes_are_the_committed_tokens_forwards(tiny):
    _, _, engine, _ = tiny
    for steps in (1, 3):
        recorder = TokenRecorder(engine.model)
        try:
            dec = _decoder(tiny, steps)
            dec.recorder = recorder
            for prompt in PROMPTS:
                out = dec.generate(
                    prompt, SamplingParams(temperature=0.0, max_new_tokens=11), torch.Generator(), frozenset()
                )
                committed = list(prompt) + out["output_ids"]
                assert out["routes"].flatten().tolist() == committed[:-1]
        finally:
            recorder.handle.remove()


def test_greedy_rule():
    logits = torch.tensor([[0.0, 3, 1], [2, 0, 1], [0, 0, 5], [9, 0, 0]])
    assert accept_greedy(logits, [1, 0, 2]) == (3, 0)  # all accepted, bonus = argmax of the last row
    assert accept_greedy(logits, [1, 2, 2]) == (1, 0)  # second rejected: the target's argmax of row 1
    assert accept_greedy(logits, [0, 0, 2]) == (0, 1)


def test_sampled_rule_is_sglangs_target_only_kernel():
    """Each part of the rule over a fine grid of its uniforms (so exact up to the grid): with q = row 0's
    target probabilities and draft d, P(accept) = q(d); after a rejection the token is drawn from q with d
    removed (renormalized); after acceptance of every draft the bonus comes from the last row. Together
    P(x) = q(d)[x = d] + (1 - q(d)) q(x) / (1 - q(d)) [x != d] = q(x)."""
    q0 = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])
    q1 = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    probs = torch.stack([q0, q1])
    grid = [(i + 0.5) / 1000 for i in range(1000)]
    for d in range(5):
        accepted = sum(accept_sampled(probs, [d], [u], 0.5)[0] for u in grid) / len(grid)
        assert abs(accepted - float(q0[d])) <= 1e-3
        after_reject = torch.zeros(5)
        for f in grid:
            n, tok = accept_sampled(probs, [d], [0.9999], f)
            if n == 0:
                after_reject[tok] += 1 / len(grid)
        if float(q0[d]) < 0.9999:
            expect = q0.clone()
            expect[d] = 0
            torch.testing.assert_close(after_reject, expect / expect.sum(), rtol=0, atol=2e-3)
        bonus = torch.zeros(5)
        for f in grid:
            n, tok = accept_sampled(probs, [d], [0.0], f)
            assert n == 1
            bonus[tok] += 1 / len(grid)
        torch.testing.assert_close(bonus, q1, rtol=0, atol=2e-3)
        # the emitted token's distribution: q0 exactly (accepted d, or the draw without d)
        emitted = float(q0[d]) * torch.nn.functional.one_hot(torch.tensor(d), 5) + (1 - float(q0[d])) * after_reject
        torch.testing.assert_close(emitted, q0, rtol=0, atol=3e-3)
    # a chain: the coin of row n decides draft n + 1; a rejection draws from that row without the draft
    chain = torch.tensor([[0.0, 1, 0], [0.5, 0.5, 0], [0.0, 0, 1], [0.2, 0.3, 0.5]])
    assert accept_sampled(chain, [1, 0, 2], [0.99, 0.3, 0.99], 0.0) == (3, 0)
    assert accept_sampled(chain, [1, 0, 2], [0.99, 0.7, 0.99], 0.0) == (1, 1)  # rejected 0 in row 1: only 1 left
    assert accept_sampled(chain, [0, 0, 2], [0.0, 0.0, 0.0], 0.99) == (0, 1)  # q(d) = 0: always rejected


def _plain_distribution(engine, prompt, k, depth):
    """The exact distribution of the first ``depth`` tokens of plain sampling at temperature 1, top-k ``k``."""
    out = {}

    def walk(prefix, p):
        if len(prefix) == depth:
            out[tuple(prefix)] = p
            return
        with torch.no_grad():
            logits = engine.model(torch.tensor([list(prompt) + prefix])).logits[0, -1:].float()
        q = torch.softmax(_top_k_top_p_filter(logits, k, 1.0), -1)[0]
        for t in torch.nonzero(q).flatten().tolist():
            walk(prefix + [t], p * float(q[t]))

    walk([], 1.0)
    return out


@pytest.mark.parametrize("draft", ["mtp", "oracle"])
def test_sampled_speculative_matches_plain_sampling(tiny, draft):
    """The first three tokens of sampled speculative decoding (temperature 1, top-k 3, two drafts per
    verify) against the exact plain distribution: the total variation of 1000 samples within three times
    its expected size under exact sampling (E TV ~ 1/2 sum_x sqrt(2 p(x) (1 - p(x)) / (pi n)), about 0.04
    here). The MTP draft (random weights: its proposals are mostly rejected) and a draft proposing the
    target's own argmax (mostly accepted) exercise both branches of the rule."""
    import math

    _, _, engine, _ = tiny
    prompt = PROMPTS[0]
    dec = _decoder(tiny, 2) if draft == "mtp" else SpeculativeDecoder(engine, OracleDraft(engine, prompt[0]), 2)
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3)
    exact = _plain_distribution(engine, prompt, 3, 3)
    gen = torch.Generator().manual_seed(123)
    counts: dict = {}
    accepted = rejected = 0
    n = 1000
    for _ in range(n):
        out = dec.generate(prompt, params, gen, frozenset())
        key = tuple(out["output_ids"])
        counts[key] = counts.get(key, 0) + 1
        accepted += out["spec"]["num_correct_drafts"]
        rejected += out["spec"]["verify_ct"] * 2 - out["spec"]["num_correct_drafts"]
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values())
    assert set(counts) <= set(exact)
    assert tv < 3 * noise, (tv, noise)
    assert rejected > 0 and (accepted > 0 or draft == "mtp")


def test_spec_meta_info_is_sglangs():
    from gspo_megatron.cpu_server.speculative import spec_meta_info

    assert spec_meta_info({"verify_ct": 0, "num_correct_drafts": 0}, 1, 4) == {}
    meta = spec_meta_info({"verify_ct": 4, "num_correct_drafts": 5, "histogram": [1, 2, 0, 1]}, 10, 4)
    assert meta == {
        "spec_accept_rate": 5 / 12,
        "spec_accept_length": 10 / 4,
        "spec_num_correct_drafts": 5,
        "spec_num_proposed_drafts": 12,
        "spec_verify_ct": 4,
        "spec_correct_drafts_histogram": [1, 2, 0, 1],
    }


def test_selector_is_sglangs():
    from gspo_megatron.cpu_server.speculative import _restated_selector, parse_selector, selector_refusal

    for parse in (parse_selector, _restated_selector):
        assert parse("all") == {"target", "draft"}
        assert parse("draft") == {"draft"}
        with pytest.raises(ValueError, match=r"invalid selector 'bogus'; expected 'target', 'draft', or 'all'"):
            parse("bogus")
    assert selector_refusal({}) is None and selector_refusal({"selector": "target"}) is None
    status, body = selector_refusal({"selector": "bogus"})
    assert status == 422 and body["detail"][0]["msg"] == "Input should be 'target', 'draft' or 'all'"


def test_cli_resolution_is_sglangs():
    from gspo_megatron.cpu_server.args import parse_args

    base = ["--model-path", "/m"]
    a = parse_args(base + ["--speculative-algorithm", "nextn"])
    assert (a.speculative_algorithm, a.speculative_num_steps, a.speculative_eagle_topk) == ("EAGLE", 3, 1)
    # no config.json at /m: no architecture of _handle_eagle_family's list, so the draft path stays unset
    # (tests/rollout/test_speculative_engine_args.py: GLM's defaults to the model, Qwen3-Next's does not)
    assert (a.speculative_num_draft_tokens, a.speculative_draft_model_path) == (4, None)
    assert a.max_running_requests == 48
    a = parse_args(
        base
        + [
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "2",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "7",
        ]
    )
    assert (a.speculative_num_steps, a.speculative_num_draft_tokens) == (2, 3)  # adjusted to steps + 1
    assert parse_args(base).speculative_algorithm is None
    for bad in (
        ["--speculative-algorithm", "MEDUSA"],
        ["--speculative-algorithm", "EAGLE3"],
        ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"],
        ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "4"],
    ):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


# -- through HTTP: one speculative CPU server ------------------------------------------------------------
STEPS = 2
TP = 2


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    pytest.importorskip("gspo_megatron.models.mtp")
    from cpu_server_util import CpuServer

    d = tiny[0]
    srv = CpuServer(
        d,
        str(tmp_path_factory.mktemp("spec_logs")),
        tp=TP,
        extra=("--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS)),
    )
    yield srv
    srv.stop()


def _send(client, bucket, selector=None):
    """One bucket to every TP rank (one payload each: a CPU payload is opened once)."""
    from gspo_megatron.weight_sync.cuda_ipc import serialize_bucket

    per_rank = [serialize_bucket(bucket) for _ in range(TP)]
    for group in range(len(per_rank[0])):
        client.update_weights_from_tensor(
            [p[group] for p in per_rank], load_format="flattened_bucket", selector=selector
        )


def _sync(client, bucket, selector=None, update_selector=None):
    """begin (selector) -> one bucket (update_selector, default the same) -> end; returns end's answer."""
    assert client.begin_weight_update(selector=selector)
    _send(client, bucket, selector if update_selector is None else update_selector)
    return client.post("end_weight_update", {})


def test_server_reports_sglangs_resolved_flags_and_decodes_greedily_as_plain(tiny, server):
    from gspo_megatron.engines.sglang_client import SGLangHttpClient
    from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine, engine_spec_metrics

    _, _, engine, _ = tiny
    client = SGLangHttpClient(server.url)
    info = client.server_info()
    assert info["speculative_algorithm"] == "EAGLE"  # NEXTN resolved
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (
        STEPS,
        1,
        STEPS + 1,
    )
    assert info["speculative_draft_model_path"] == tiny[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = engine.generate(PROMPTS, 1, params)
    outs = client.generate(PROMPTS, [{"temperature": 0.0, "max_new_tokens": 12}] * len(PROMPTS), return_logprob=True)
    for out, [r] in zip(outs, ref):
        assert out["output_ids"] == r.response_ids
        meta = out["meta_info"]
        lps = [e[0] for e in meta["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(r.response_logprobs), rtol=0, atol=2e-5)
        verify = meta["spec_verify_ct"]
        assert verify >= 1 and meta["spec_num_proposed_drafts"] == verify * STEPS
        assert meta["spec_accept_length"] == meta["completion_tokens"] / verify
        assert meta["spec_accept_rate"] == meta["spec_num_correct_drafts"] / (verify * STEPS)
    # the client keeps the counts on each sample; the step's metrics are their sums
    samples = [g[0] for g in SGLangRolloutEngine([client]).generate(PROMPTS, 1, params)]
    assert [s.spec_verify_ct for s in samples] == [o["meta_info"]["spec_verify_ct"] for o in outs]
    m = engine_spec_metrics(samples)
    verify = sum(s.spec_verify_ct for s in samples)
    assert m["spec/engine_accept_length"] == sum(len(s.response_ids) for s in samples) / verify
    assert m["spec/engine_accept_rate"] == sum(s.spec_num_correct_drafts for s in samples) / (verify * STEPS)


def _perturbed(tensors, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def test_selector_reaches_the_right_runner_and_the_written_check_holds_for_both(tiny, server):
    from gspo_megatron.cpu_server import read_weight_shards
    from gspo_megatron.engines.sglang_client import SGLangHttpClient

    d, hf, engine, mtp = tiny
    client = SGLangHttpClient(server.url)
    n = hf["num_hidden_layers"]
    own = {k: v for k, v in mtp.items() if not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))}
    target = {name: t.detach().clone() for name, t in [(x, engine.layout.target(x)) for x in engine.checkpoint_names()]}
    probe_t, probe_d = "model.layers.0.input_layernorm.weight", f"model.layers.{n}.enorm.weight"

    def read():
        r = read_weight_shards(server.url, [probe_t, probe_d])[0]
        return r[probe_t], r[probe_d]

    t0, d0 = read()
    # draft only: the whole MTP layer (names of the target too: the draft's loader skips them)
    new_mtp = _perturbed(own, 0.05, 1)
    bucket = sorted({**target, **new_mtp, probe_t: target[probe_t] + 1}.items())
    assert _sync(client, bucket, "draft")["success"]
    t1, d1 = read()
    assert torch.equal(t1, t0) and torch.equal(d1, new_mtp[probe_d])
    # target only: the MTP layer in the bucket is skipped by the target
    newer_mtp = _perturbed(own, 0.05, 2)
    assert _sync(client, sorted({**target, probe_t: target[probe_t] + 1, **newer_mtp}.items()), "target")["success"]
    t2, d2 = read()
    assert torch.equal(t2, target[probe_t] + 1) and torch.equal(d2, d1)
    # all (the default): both; a sync without any MTP tensor leaves the draft as it was (model.mtp=false)
    assert _sync(client, sorted({**target, **newer_mtp}.items()))["success"]
    t3, d3 = read()
    assert torch.equal(t3, target[probe_t]) and torch.equal(d3, newer_mtp[probe_d])
    assert _sync(client, sorted(target.items()))["success"]
    assert torch.equal(read()[1], newer_mtp[probe_d])
    # a partial MTP layer fails the draft's written check, naming sglang's draft parameter
    partial = {k: v for k, v in newer_mtp.items() if not k.endswith("eh_proj.weight")}
    from gspo_megatron.engines.sglang_client import SGLangError

    with pytest.raises(
        SGLangError, match=r"HTTP 400.*draft Glm4MoeForCausalLMNextN.load_weights left 1 .*model.eh_proj.weight"
    ):
        _sync(client, sorted(partial.items()), "draft")
    # the draft generates with what was synced: counts equal the in-process decoder's with newer_mtp
    assert _sync(client, sorted({**target, **newer_mtp}.items()))["success"]
    model = engine.model
    draft = MTPDraft(hf, newer_mtp, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    dec = SpeculativeDecoder(engine, draft, STEPS)
    for prompt in PROMPTS:
        ref = dec.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12), torch.Generator(), frozenset())
        meta = client.generate([prompt], [{"temperature": 0.0, "max_new_tokens": 12}])[0]["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (
            ref["spec"]["verify_ct"],
            ref["spec"]["num_correct_drafts"],
        )


def test_a_bad_selector_is_refused_as_sglang_refuses_it(server):
    import json
    import urllib.error
    import urllib.request

    for route, body in [
        ("begin_weight_update", {"selector": "both"}),
        ("update_weights_from_tensor", {"serialized_named_tensors": [], "selector": "both"}),
        (
            "update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": [], "group_name": "g", "selector": 3},
        ),
    ]:
        req = urllib.request.Request(
            f"{server.url}/{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 422
        detail = json.loads(e.value.read())["detail"][0]
        assert detail["type"] == "literal_error" and detail["loc"] == ["body", "selector"]
        assert detail["msg"] == "Input should be 'target', 'draft' or 'all'"
