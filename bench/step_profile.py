"""Where the time of one GSPO training step goes, and what Megatron-Core itself costs for the same work.

Model, batch and setup are bench/gpu_bench.py's ``train``: a Qwen3-MoE-shaped model of ~1.6B
parameters in bf16 (``--tiny``: the demo's tiny MoE in fp32 on CPU; numbers meaningless, for CI),
``--sequences`` sequences of ``--prompt`` prompt tokens and RL-like (log-normal) response lengths up to
``--max-response``, DDP + distributed optimizer on one rank, Megatron's local layer spec.

- ``baseline``: our step (``trainer.step.train_on_batch``: old log-probs, then one optimizer step per
  mini-batch through Megatron's schedule, our log-prob head and GSPO loss) against Megatron-Core
  doing the same work in the same process: one forward-only pass over the same micro-batches
  (GPTModel's logits, log-probs = -``tensor_parallel.vocab_parallel_cross_entropy``), then per
  mini-batch forward + backward (GPTModel's forward with labels: its output layer and
  vocab-parallel cross entropy, masked mean) through ``get_forward_backward_func`` and
  ``optimizer.step()`` on the same DDP model and optimizer. Both use our batch split
  (``trainer.step.split_batch``: the same padded rows or packed micro-batches); the tokens each step
  pushes through the model are counted by a forward pre-hook and must be equal (else RuntimeError).
  After one warm-up step each, ``--repeats`` steps of each are timed, alternating, synchronized on
  CUDA; reported: median step seconds and ``ratio ours/megatron = median ours / median megatron``.
  Run padded and, when the config has ``parallel.max_tokens_per_micro_batch``, packed.
- ``profile``: torch.profiler over one step of ours (padded and packed). Each op's self device time
  (CUDA kernels on a GPU, self CPU time on CPU) goes to a bucket by the innermost ``bench:*``
  range around it (set here with module hooks and wrappers, no library code changed; backward ops
  inherit their forward op's ranges by autograd sequence number), else by kernel / op name:
  attention, experts (expert / MLP GEMMs), router_dispatch (router, top-k, permute, all-to-all),
  logprob_head (output layer + our vocab-parallel log-probs), loss, packing (batch split / packing,
  routing-replay bookkeeping), optimizer, grad_reduce (DDP finalize, all-reduce / reduce-scatter,
  main-grad accumulation), other; plus host_idle = step wall time - device busy time (host-side
  Python, launches, syncs: the GPU idle). share = bucket seconds / (busy + host_idle) * 100.
  Profiler overhead inflates host_idle; compare shares within one run.

Usage: python bench/step_profile.py {baseline,profile,all} [--json out.json] [--tiny] [--sequences N]
         [--prompt P] [--max-response R] [--micro-batch-size M] [--mini-batches K] [--repeats K]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/gpu_bench.py

import gpu_bench

RANGE = "bench:"  # prefix of the record_function ranges this bench adds
BUCKETS = (
    "attention",
    "experts",
    "router_dispatch",
    "logprob_head",
    "loss",
    "packing",
    "optimizer",
    "grad_reduce",
    "other",
    "host_idle",
)
RANGE_BUCKETS = {"mlp": "experts", "moe": "router_dispatch", "router": "router_dispatch"}
# (substrings of a lower-cased op / kernel name, bucket), first match wins; used outside any range
NAME_RULES = (
    (("nccl", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather", "c10d", "gloo"), "grad_reduce"),
    (("accumulategrad",), "grad_reduce"),
    (("alltoall", "all_to_all", "topk", "moe_permute", "unpermute", "permute_tokens"), "router_dispatch"),
    (("adam", "multi_tensor", "optimizer"), "optimizer"),
    (("flash", "fmha", "attention", "sdpa"), "attention"),
    (("grouped_gemm", "groupedgemm", "grouped_mm"), "experts"),
    (("cross_entropy", "log_softmax", "logsumexp"), "logprob_head"),
)


# -------------------------------------------------------------------------------- bucketing (pure)
def classify(name: str) -> str:
    """The bucket of one event named ``"bench:range/.../op_or_kernel"`` (enclosing ranges outermost
    first): the innermost ``bench:`` range that names a bucket, else the first :data:`NAME_RULES`
    match on the rest of the name, else ``other``."""
    parts = name.split("/")
    for p in reversed(parts):
        if p.startswith(RANGE):
            r = p[len(RANGE) :]
            bucket = RANGE_BUCKETS.get(r, r)
            if bucket in BUCKETS:
                return bucket
    rest = "/".join(p for p in parts if not p.startswith(RANGE)).lower()
    for keys, bucket in NAME_RULES:
        if any(k in rest for k in keys):
            return bucket
    return "other"


def bucket_shares(events, wall_s: float | None = None) -> dict:
    """Pure: ``events`` a list of (name, seconds) of device work (names as :func:`classify` reads
    them); ``wall_s`` the step's wall time. Returns seconds and percent per bucket (every bucket of
    :data:`BUCKETS`), host_idle = max(0, wall - busy); the percents sum to 100."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    for name, dur in events:
        seconds[classify(name)] += float(dur)
    busy = sum(seconds.values())
    seconds["host_idle"] = max(0.0, wall_s - busy) if wall_s is not None else 0.0
    total = busy + seconds["host_idle"]
    percent = {k: (100.0 * v / total if total > 0 else 0.0) for k, v in seconds.items()}
    return {"seconds": seconds, "percent": percent, "busy_s": busy, "wall_s": wall_s}


# ------------------------------------------------------------------------------- trace -> events
def trace_events(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, seconds) per CUDA kernel (named ``ranges/op/kernel``) or, on CPU, per op's self CPU time
    (``ranges/op``; ranges left out: their self time is Python), ``ranges`` the ``bench:`` ranges
    around the op; a backward op gets those of its forward op (same autograd sequence number and
    forward thread) and the autograd node's name."""
    from torch.autograd import DeviceType

    evts = [e for e in prof.events() if e.device_type == DeviceType.CPU]

    memo: dict = {}

    def ranges(e) -> list[str]:  # the bench: ranges around e, outermost first
        if e is None:
            return []
        if id(e) not in memo:
            memo[id(e)] = ranges(e.cpu_parent) + ([e.name] if e.name.startswith(RANGE) else [])
        return memo[id(e)]

    def bw_parent(e):  # the autograd node this op runs in (scope 1: BACKWARD_FUNCTION), if any
        while e is not None and e.scope != 1 and not e.name.startswith("autograd::engine::evaluate_function"):
            e = e.cpu_parent
        return e

    fwd: dict = {}  # the last forward op with a sequence number is the one that made its autograd node
    for e in sorted(evts, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and bw_parent(e) is None:
            fwd[(e.sequence_nr, e.thread)] = ranges(e)
    out = []
    for e in evts:
        if cuda:  # the kernels this op launched itself (not a range's own device-side annotation)
            work = [(k.name, k.duration) for k in e.kernels if not k.name.startswith(RANGE)]
        elif not (e.name.startswith(RANGE) or e.is_user_annotation):
            work = [(None, e.self_cpu_time_total)]
        else:
            continue
        path = ranges(e)
        p = bw_parent(e)
        if p is not None:
            path = path + fwd.get((p.sequence_nr, p.fwd_thread), []) + [p.name]
        for kernel, us in work:
            if us > 0:
                out.append(("/".join(path + [e.name] + ([kernel] if kernel else [])), us / 1e6))
    return out


@contextlib.contextmanager
def phase_ranges(ddp):
    """``bench:`` record_function ranges around the step's phases, for the profiled step only: module
    hooks (attention, MoE layer, router, experts, dense MLP, output layer) and wrappers of the step's
    functions (batch split, routing-replay bookkeeping, loss, log-prob head, optimizer, DDP finalize)."""
    import torch

    from gspo_megatron.losses import megatron_loss
    from gspo_megatron.models.lm_head import unwrap_gpt
    from gspo_megatron.trainer import route_replay, step  # micro_batches reads route_replay.* at call time

    def rng(label, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            with torch.profiler.record_function(RANGE + label):
                return fn(*a, **k)

        return inner

    def returns_ranged(label, make):
        return functools.wraps(make)(lambda *a, **k: rng(label, make(*a, **k)))

    patches = [
        (step, "split_batch", rng("packing", step.split_batch)),
        (route_replay, "before_forward", rng("packing", route_replay.before_forward)),
        (route_replay, "after_forward", rng("packing", route_replay.after_forward)),
        (step, "make_megatron_loss_func", returns_ranged("loss", step.make_megatron_loss_func)),
        (
            megatron_loss,
            "make_megatron_logprob_func",
            returns_ranged("logprob_head", megatron_loss.make_megatron_logprob_func),
        ),
        (megatron_loss, "vocab_parallel_logprobs", rng("logprob_head", megatron_loss.vocab_parallel_logprobs)),
        (
            megatron_loss,
            "fused_vocab_parallel_logprobs",
            rng("logprob_head", megatron_loss.fused_vocab_parallel_logprobs),
        ),
        (step, "optimizer_step", rng("optimizer", step.optimizer_step)),
        (step, "zero_grads", rng("optimizer", step.zero_grads)),
    ]
    if ddp.config.finalize_model_grads_func is not None:  # the schedule reads it from the config at each call
        finalize = rng("grad_reduce", ddp.config.finalize_model_grads_func)
        patches.append((ddp.config, "finalize_model_grads_func", finalize))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    labels = {"self_attention": "attention", "router": "router", "experts": "experts", "shared_experts": "experts"}
    handles, open_ranges = [], []
    for name, mod in unwrap_gpt(ddp).named_modules():
        last = name.rsplit(".", 1)[-1]
        label = labels.get(last)
        if last == "mlp":
            label = "moe" if type(mod).__name__ == "MoELayer" else "mlp"
        elif name == "output_layer":
            label = "logprob_head"
        if label is None:
            continue

        def pre(_m, _a, label=label):
            r = torch.profiler.record_function(RANGE + label)
            r.__enter__()
            open_ranges.append(r)

        def post(*_):  # returns None: the module's output stays as it is
            open_ranges.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj, name, old in saved:
            setattr(obj, name, old)


# ------------------------------------------------------------------------------- the two steps
class TokenCounter:
    """Tokens pushed through the model (every forward, both passes): a forward pre-hook on the GPTModel."""

    def __init__(self, ddp):
        from gspo_megatron.models.lm_head import unwrap_gpt

        self.n = 0
        self.handle = unwrap_gpt(ddp).register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _m, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.n += int(ids.numel())

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _mc_forward(train: bool, data_iterator, model):
    """Megatron's own forward step: GPTModel logits (old log-probs) or its per-token loss with labels."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from gspo_megatron.trainer.packing import packed_seq_params

    b = next(data_iterator)
    labels = b["labels"].clamp(min=0)  # padding (-100) is masked by loss_mask
    psp = packed_seq_params(b)
    if not train:
        logits = model(b["tokens"], b["position_ids"], attention_mask=None, packed_seq_params=psp)

        def old_logprobs(out):
            lp = -vocab_parallel_cross_entropy(out, labels)
            b["old_logprobs"] = lp.float()
            return lp.sum(), {"logprobs": lp}

        return logits, old_logprobs
    loss = model(b["tokens"], b["position_ids"], attention_mask=None, labels=labels, packed_seq_params=psp)
    mask = b["loss_mask"]

    def masked_mean(out):
        total = (out.float() * mask).sum() / mask.sum().clamp(min=1)
        return total, {"lm loss": total.detach()}

    return loss, masked_mean


def megatron_step(cfg, ddp, optimizer, scheduler, records, pad_id: int) -> None:
    """Megatron-Core's cost for the same work: forward-only pass, then per mini-batch forward +
    backward through its schedule and ``optimizer.step()``, on our micro-batches."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.trainer.step import row_multiple, split_batch

    minis = split_batch(cfg, records, 1, 0, pad_id, multiple=row_multiple(cfg, 1, 1))
    fb = get_forward_backward_func()

    def run(micro, train):
        return fb(
            forward_step_func=functools.partial(_mc_forward, train),
            data_iterator=iter(micro),
            model=[ddp],
            num_microbatches=len(micro),
            seq_length=max(b["tokens"].shape[1] for b in micro),
            micro_batch_size=max(b["tokens"].shape[0] for b in micro),
            forward_only=not train,
        )

    ddp.eval()
    with torch.no_grad():
        run([b for mb in minis for b in mb], train=False)
    ddp.train()
    for micro in minis:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run(micro, train=True)
        applied, _, _ = optimizer.step()
        if applied:
            scheduler.step(increment=1)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def setup(args):
    """(records, model, ddp, optimizer, scheduler, {layout: cfg}) as bench/gpu_bench.py builds them."""
    import torch

    from gspo_megatron.config import load_config
    from gspo_megatron.sample import Sample

    warnings.filterwarnings("ignore", module=r"megatron\.")  # CPU-fallback notices (no apex / TE)
    hf = gpu_bench.hf_config(args.tiny)
    g = torch.Generator().manual_seed(1)
    records = []
    for i, r in enumerate(gpu_bench.response_lengths(args.sequences, args.max_response)):
        toks = torch.randint(0, hf["vocab_size"], (args.prompt + r,), generator=g).tolist()
        records.append(Sample.from_tokens(toks, args.prompt, advantage=float((-1) ** i), engine_logprobs=[-1.0] * r))
    cfg, model, ddp, optimizer, scheduler = gpu_bench._build(args, packed=False)
    extra = [f"gspo.mini_batches={args.mini_batches}"]
    cfgs = {"padded": load_config(None, gpu_bench.overrides(args, False) + extra)}
    if gpu_bench.has_packing():
        cfgs["packed"] = load_config(None, gpu_bench.overrides(args, True) + extra)
    return records, model, ddp, optimizer, scheduler, cfgs


def run_baseline(args, state) -> dict:
    from gspo_megatron.trainer.step import train_on_batch

    records, _, ddp, optimizer, scheduler, cfgs = state
    counter = TokenCounter(ddp)
    out = {}
    try:
        for layout, cfg in cfgs.items():
            steps = {
                "ours": lambda cfg=cfg: train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0),
                "megatron": lambda cfg=cfg: megatron_step(cfg, ddp, optimizer, scheduler, records, pad_id=0),
            }
            times: dict = {k: [] for k in steps}
            tokens: dict = {}
            for rep in range(args.repeats + 1):  # the first is a warm-up
                for k, fn in steps.items():
                    gpu_bench._sync()
                    counter.take()
                    t0 = time.perf_counter()
                    fn()
                    gpu_bench._sync()
                    sec = time.perf_counter() - t0
                    tokens[k] = counter.take()
                    if rep:
                        times[k].append(sec)
            if tokens["ours"] != tokens["megatron"]:
                raise RuntimeError(f"{layout}: ours pushed {tokens['ours']} tokens, megatron {tokens['megatron']}")
            ours, mc = statistics.median(times["ours"]), statistics.median(times["megatron"])
            out[layout] = {
                "device": _device(),
                "ours_step_s": ours,
                "megatron_step_s": mc,
                "ratio_ours_over_megatron": ours / mc,
                "tokens_through_model": dict(tokens),  # ours / megatron: equal (checked above)
                "ours_steps_s": times["ours"],
                "megatron_steps_s": times["megatron"],
            }
            print(f"[{layout}] step s: ours {ours:.4f}  megatron {mc:.4f}  ({tokens['ours']} tokens/step each)")
            print(f"[{layout}] ratio ours/megatron: {ours / mc:.3f}", flush=True)
    finally:
        counter.handle.remove()
    return out


def run_profile(args, state, warm: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gspo_megatron.trainer.step import train_on_batch

    records, _, ddp, optimizer, scheduler, cfgs = state
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for layout, cfg in cfgs.items():
        if not warm:
            train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0)
        gpu_bench._sync()
        with phase_ranges(ddp), profile(activities=acts) as prof:
            t0 = time.perf_counter()
            train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0)
            gpu_bench._sync()
            wall = time.perf_counter() - t0
        res = bucket_shares(trace_events(prof, cuda), wall)
        res["time"] = "cuda kernels" if cuda else "cpu ops (self)"
        res["device"] = _device()
        out[layout] = res
        print(f"\n[{layout}] one step of ours, {wall:.3f} s wall under the profiler; share of the step:")
        for k in BUCKETS:
            print(f"  {k:16s}{res['percent'][k]:7.1f} %  {res['seconds'][k]:9.4f} s")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["baseline", "profile", "all"])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per step")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps of each (after one warm-up)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny MoE in fp32: runs on CPU (smoke test)")
    args = ap.parse_args(argv)
    if min(args.sequences, args.prompt, args.max_response, args.micro_batch_size, args.mini_batches, args.repeats) < 1:
        raise SystemExit("sizes, --mini-batches and --repeats must be >= 1")
    if args.sequences % args.mini_batches:
        raise SystemExit(f"--sequences {args.sequences} must be divisible by --mini-batches {args.mini_batches}")
    state = setup(args)
    print(
        f"GSPO step on {_device()}{' (--tiny: numbers meaningless)' if args.tiny else ''}: {args.sequences} "
        f"sequences, prompt {args.prompt}, responses <= {args.max_response}, micro-batch {args.micro_batch_size}, "
        f"{args.mini_batches} optimizer step(s); layouts {', '.join(state[-1])}",
        flush=True,
    )
    res: dict = {}
    if args.what in ("baseline", "all"):
        res["baseline"] = run_baseline(args, state)
    if args.what in ("profile", "all"):
        res["profile"] = run_profile(args, state, warm=args.what == "all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
