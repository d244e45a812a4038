"""Peak memory and time of the log-prob head: fused vs chunked vocab-parallel vs full log_softmax.

All three paths start from the hidden states [N, H] and the output weight [V, H] (one TP rank holding
the whole vocab, the weight and hidden states in ``--dtype``), compute per-token log-probs of the
targets and entropies, a weighted sum of the two as the loss, and its backward into hidden states and
weight (the output layer's GEMMs included in every path):

- full:    logits = h @ W^T, then log_softmax over the whole [N, V] in fp32 (autograd keeps it);
- chunked: logits = h @ W^T, then ``vocab_parallel_logprobs`` (today's unfused path: the [N, V]
           logits and their gradient exist, the fp32 softmax is chunked);
- fused:   ``fused_vocab_parallel_logprobs(h, W, ...)``: no [N, V] tensor at all, its per-chunk
           softmax arithmetic as a training run picks it (``kernels="auto"``: torch.compile'd on a
           GPU with Triton, eager elsewhere; gspo_megatron/losses/chunk_kernels.py);
- fused_eager / fused_compiled: the same with the per-chunk arithmetic forced eager / compiled
           (fused_eager is the head as it was before the compiled kernels).

The issue's goal for the fused head is its time within 1.25x of the full path's; the ratio is printed
as ``fused / full``. A path that compiles is run once, untimed, on two chunks' worth of tokens first,
so that compiling is not in its time.

Measured in the same process, one path after the other, per token count:
- peak memory: on CUDA ``torch.cuda.max_memory_allocated`` minus the allocation before the run; on
  CPU the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs) minus the
  resident size before the run (tensors this large are mmap'd and unmapped when freed, so RSS tracks
  the live tensors). Inputs (h, W, targets) are allocated before and not counted; their gradients are.
- time: wall-clock of forward + backward (synchronized on CUDA), best of ``--repeats``.
A path whose estimated peak exceeds ``--max-gib`` is skipped (printed as such).

Usage: python bench/logprobs.py [--tokens 2048,8192,32768] [--vocab 151936] [--hidden 2048]
    [--dtype bf16] [--device auto] [--paths full,chunked,fused,fused_eager] [--max-gib 8] [--json out.json]
CPU defaults are sized for the 2-core CI machine (see docs/bench.md for the command used there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from gspo_megatron.losses import vocab_parallel_logprobs
from gspo_megatron.losses.chunk_kernels import chunk_ops
from gspo_megatron.losses.chunking import chunk_tokens
from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs

TEMPERATURE = 0.8
PATHS = ("full", "chunked", "fused", "fused_eager")
FUSED = {"fused": "auto", "fused_eager": "eager", "fused_compiled": "compiled"}  # path -> kernels


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def full_log_softmax(h, w, targets):
    """The baseline: the whole [N, V] fp32 log-softmax, kept by autograd for backward."""
    logp = torch.log_softmax((h @ w.t()).float() / TEMPERATURE, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def chunked(h, w, targets):
    return vocab_parallel_logprobs(h @ w.t(), targets, temperature=TEMPERATURE)


def fused(kernels: str):
    def fn(h, w, targets):
        return fused_vocab_parallel_logprobs(h, w, targets, temperature=TEMPERATURE, kernels=kernels)

    return fn


FNS = {"full": full_log_softmax, "chunked": chunked, **{path: fused(k) for path, k in FUSED.items()}}


def warm_up(path: str, h, w, targets, wl) -> None:
    """Compile a compiling path's kernels (untimed) on two chunks of tokens: the graphs are dynamic in
    the token count, so the timed run reuses them."""
    ops = chunk_ops(h.device, FUSED[path]) if path in FUSED else None  # type: ignore[arg-type]
    if ops is None or ops.form != "compiled":
        return
    rows = min(h.shape[0], 2 * chunk_tokens(None, w.shape[0], ops.temp_bytes(w.dtype)) + 1)  # the head's own chunk
    lp, ent = FNS[path](h[:rows], w, targets[:rows])
    ((lp * wl[:rows]).sum() + ent.sum()).backward()
    h.grad = w.grad = None


def estimate_bytes(path: str, n: int, v: int, hdim: int, elt: int) -> int:
    """A rough upper estimate of a path's extra peak (to skip what cannot fit)."""
    grads = (n + v) * hdim * (elt + 4)
    if path == "full":
        return n * v * (elt + 4 * 3) + grads
    if path == "chunked":
        return n * v * elt * 2 + 3 * 256 * 2**20 + grads
    return 3 * 256 * 2**20 + v * hdim * 4 + grads


def measure(fn, h, w, targets, wl, repeats: int, cuda: bool):
    """(peak extra bytes, best seconds, logprobs, entropy, grad_h, grad_w) of forward + backward."""
    best, peak = float("inf"), 0
    for _ in range(repeats):
        h.grad = w.grad = None
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
                f.write("5")
        t0 = time.perf_counter()
        lp, ent = fn(h, w, targets)
        ((lp * wl).sum() + (ent * wl.flip(0)).sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        now = torch.cuda.max_memory_allocated() - base if cuda else _rss_bytes("VmHWM") - base
        peak = max(peak, now)
        lp, ent = lp.detach(), ent.detach()
    return peak, best, lp, ent, h.grad, w.grad


def run(tokens: int, args, dev: torch.device) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(tokens, args.hidden, generator=g, device=dev) / args.hidden**0.25).to(dtype).requires_grad_(True)
    w = (torch.randn(args.vocab, args.hidden, generator=g, device=dev) * 3 / args.hidden**0.25).to(dtype)
    w.requires_grad_(True)
    targets = torch.randint(0, args.vocab, (tokens,), generator=g, device=dev)
    wl = torch.randn(tokens, generator=g, device=dev)
    elt = h.element_size()
    res = {
        "tokens": tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "device": str(dev),
        "paths": {},
    }
    outs = {}
    for path in args.paths:
        need = estimate_bytes(path, tokens, args.vocab, args.hidden, elt)
        if need > args.max_gib * 2**30:
            res["paths"][path] = {"skipped": f"needs ~{need / 2**30:.1f} GiB > --max-gib {args.max_gib:g}"}
            continue
        warm_up(path, h, w, targets, wl)
        peak, sec, lp, ent, gh, gw = measure(FNS[path], h, w, targets, wl, args.repeats, cuda)
        outs[path] = (lp, ent, gh.float().clone(), gw.float().clone())
        res["paths"][path] = {"peak_mib": peak / 2**20, "seconds": sec}
        h.grad = w.grad = None
    ref = next((p for p in ("full", "chunked") if p in outs), None)
    for path in (p for p in FUSED if p in outs and ref):
        a, b = outs[path], outs[ref]
        res[f"max_abs_diff_{path}_vs_{ref}"] = {
            k: (x - y).abs().max().item()
            for k, x, y in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), a, b)
        }
    fused_s = res["paths"].get("fused", {}).get("seconds")
    full_s = res["paths"].get("full", {}).get("seconds")
    if fused_s and full_s:
        res["fused_over_full_time"] = fused_s / full_s
    del h, w, outs
    gc.collect()
    return res


def print_result(res: dict) -> None:
    mib = res["paths"]
    print(
        f"\ntokens={res['tokens']} vocab={res['vocab']} hidden={res['hidden']} {res['dtype']} on {res['device']}"
        f" (logits alone: {res['tokens'] * res['vocab'] * (2 if res['dtype'] == 'bf16' else 4) / 2**20:.0f} MiB)"
    )
    print(f"{'':28s}{'peak extra MiB':>16s}{'fwd+bwd s':>12s}")
    for path, r in mib.items():
        if "skipped" in r:
            print(f"{path:28s}  skipped: {r['skipped']}")
        else:
            print(f"{path:28s}{r['peak_mib']:16.0f}{r['seconds']:12.3f}")
    f = mib.get("fused", {})
    for base in ("full", "chunked"):
        b = mib.get(base, {})
        if "peak_mib" in f and "peak_mib" in b:
            print(
                f"{base} / fused: memory {b['peak_mib'] / max(f['peak_mib'], 1e-9):.2f}x, "
                f"time {b['seconds'] / f['seconds']:.2f}x"
            )
    if "fused_over_full_time" in res:
        print(f"fused / full: time {res['fused_over_full_time']:.2f}x (goal: within 1.25x)")
    for k, v in res.items():
        if k.startswith("max_abs_diff"):
            print(f"{k}: " + ", ".join(f"{n} {x:.2e}" for n, x in v.items()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192,32768", help="comma-separated token counts")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="skip a path whose estimated peak exceeds this (default: 90%% of free GPU memory; 8 on CPU)",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in args.paths if p not in FNS]
    if bad:
        ap.error(f"--paths: unknown {bad}; choose from {list(FNS)}")
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if args.max_gib is None:
        args.max_gib = torch.cuda.mem_get_info()[0] * 0.9 / 2**30 if dev.type == "cuda" else 8.0
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        res = run(tokens, args, dev)
        print_result(res)
        results.append(res)
    out = {"bench": "logprobs", "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
