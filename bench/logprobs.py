"""Peak memory and time: chunked vocab-parallel log-prob + entropy vs log_softmax over the full logits.

Both paths compute per-token log-probs of the targets and entropies from logits [N, V] (one TP rank
holding the whole vocab), a weighted sum of the two as the loss, and its backward into the logits.
Measured in the same process, one after the other:

- peak memory: the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs before
  each run) minus the resident size before the run. Tensors this large are mmap'd by the allocator and
  unmapped when freed, so RSS tracks the live tensors; the inputs and the logits' gradient buffer are
  counted the same way for both paths. Linux only.
- time: wall-clock of forward + backward, best of ``--repeats``.

Usage: python bench/logprobs.py [--tokens 2048] [--vocab 151936] [--dtype bf16] [--repeats 1]
Runs in well under 2 minutes on 2 CPU cores at the defaults (about 3 GiB of memory at the peak).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from gspo_megatron.losses import vocab_parallel_logprobs

TEMPERATURE = 0.8


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


def full_log_softmax(logits: torch.Tensor, targets: torch.Tensor):
    """The baseline: the whole [N, V] fp32 log-softmax, kept by autograd for backward."""
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def chunked(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None):
    return vocab_parallel_logprobs(logits, targets, temperature=TEMPERATURE, chunk_size=chunk_size)


def measure(fn, logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, repeats: int):
    """(peak extra bytes, best seconds, logprobs, entropy, grad) of forward + backward."""
    best, peak = float("inf"), 0
    for _ in range(repeats):
        logits.grad = None
        gc.collect()
        base = _rss_bytes("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        lp, ent = fn(logits, targets)
        ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, _rss_bytes("VmHWM") - base)
        lp, ent = lp.detach(), ent.detach()
    return peak, best, lp, ent, logits.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: ~256 MiB fp32)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 3).to(dtype).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    w = torch.randn(args.tokens, generator=g)
    mib = 2**20
    print(f"tokens={args.tokens} vocab={args.vocab} logits={args.dtype} "
          f"({logits.numel() * logits.element_size() / mib:.0f} MiB) threads={torch.get_num_threads()}")

    c_peak, c_time, c_lp, c_ent, c_grad = measure(
        lambda x, y: chunked(x, y, args.chunk_size), logits, targets, w, args.repeats)
    c_grad = c_grad.clone()
    f_peak, f_time, f_lp, f_ent, f_grad = measure(full_log_softmax, logits, targets, w, args.repeats)

    print(f"{'':28s}{'peak extra MiB':>16s}{'fwd+bwd s':>12s}")
    print(f"{'full log_softmax':28s}{f_peak / mib:16.0f}{f_time:12.3f}")
    print(f"{'chunked vocab-parallel':28s}{c_peak / mib:16.0f}{c_time:12.3f}")
    print(f"memory ratio (full / chunked): {f_peak / max(c_peak, 1):.2f}x")
    print(f"time ratio   (full / chunked): {f_time / c_time:.2f}x")
    print(f"max |diff|: logprobs {(c_lp - f_lp).abs().max().item():.2e}, "
          f"entropy {(c_ent - f_ent).abs().max().item():.2e}, "
          f"grad {(c_grad.float() - f_grad.float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
