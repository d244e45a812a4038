"""Sanity check that the demo task is learnable by group-advantage RL from a random init.

A randomly initialized tiny Qwen3-MoE (transformers) with the byte tokenizer samples G responses per
prompt through HFRolloutEngine, is scored with the task's shaped reward, and takes one on-policy
policy-gradient step per batch (GSPO's gradient at s_i = 1: A_i * mean_t grad log p). Prints the mean
reward per step. Not a test: run ``python bench/demo_task_sanity.py --minutes 3``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import Qwen3MoeConfig

from gspo_megatron.data.dataset import decode_response, format_prompt
from gspo_megatron.data.tasks import get_task
from gspo_megatron.data.tokenizer import build_demo_tokenizer, padded_vocab_size
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="last_digit")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untied", action="store_true", help="separate output layer (tied embeddings give a copy bias)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    tok = build_demo_tokenizer()
    task = get_task(args.task)
    config = Qwen3MoeConfig(
        vocab_size=padded_vocab_size(len(tok)),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=not args.untied,
    )
    engine = HFRolloutEngine(config, seed=args.seed)
    model = engine.model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens, stop_token_ids=[tok.eos_token_id])
    rows = task.rows(100_000, seed=args.seed)
    rng = random.Random(args.seed)
    start, step = time.time(), 0
    while time.time() - start < args.minutes * 60:
        batch = rng.sample(rows, args.prompts)
        prompt_ids = [tok.encode(format_prompt(tok, r["prompt"]), add_special_tokens=False) for r in batch]
        model.eval()
        groups = engine.generate(prompt_ids, args.group, params)
        seqs, advs, rewards = [], [], []
        for row, group in zip(batch, groups):
            r = torch.tensor([task.reward(row["prompt"], decode_response(tok, s), row["label"]) for s in group])
            rewards += r.tolist()
            a = (r - r.mean()) / (r.std() + 1e-6)
            for s, ai in zip(group, a.tolist()):
                seqs.append(s)
                advs.append(ai)
        model.train()
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width)
        for i, s in enumerate(seqs):
            full = s.prompt_ids + s.response_ids
            ids[i, : len(full)] = torch.tensor(full)
            mask[i, len(s.prompt_ids) : len(full)] = 1.0
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        m = mask[:, 1:]
        seq_mean = (logp * m).sum(-1) / m.sum(-1).clamp(min=1)
        loss = -(torch.tensor(advs) * seq_mean).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 5 == 0 or step == 1:
            texts = [decode_response(tok, s) for s in seqs[:: args.group][:4]]
            print(
                f"step {step:4d}  t={time.time() - start:6.1f}s  reward/mean={sum(rewards) / len(rewards):.3f}"
                f"  samples={texts}  labels={[r['label'] for r in batch[:4]]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
