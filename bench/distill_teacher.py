"""A teacher for the on-policy distillation bench (bench/distill.py): the CPU demo's tiny model, trained
by plain supervised fine-tuning on a built-in task's correct answers.

The teacher is an HF model directory (config.json, model.safetensors, and the student's tokenizer
files) of the student's architecture (the demo's ``model.arch``), so it shares the student's
tokenizer, as ``distill.teachers`` requires. It is built with the trainer's own functions: the
random init and tokenizer by ``factory.hf_init_dir`` (under the teacher's ``seed``), the prompts by
``factory.build_dataset`` (the task's rows under ``seed``, formatted with the chat template exactly as
the trainer formats them, ``data.dataset.format_prompt`` / ``encode_prompt``). Training: transformers'
``AutoModelForCausalLM`` in fp32, AdamW (linear warm-up, linear decay), cross-entropy on the answer's
tokens and the end-of-turn token ``<|im_end|>`` (the student's stop token) only. Deterministic for a
seed (one thread, fixed batch order: the same weights bit for bit). ~15 s for the default 200 steps on 2 CPU cores.

Greedy accuracy is measured on held-out rows: the task's rows under ``seed + 1`` whose prompt the
teacher never saw (a small task such as ``add_digits``, 100 distinct prompts, has none: then on those
rows anyway, marked ``held_out: false``). The report is written to ``<out>/sft_report.json``.

    python bench/distill_teacher.py --out /tmp/teacher [--task last_digit --steps 200 --seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo_cpu.yaml")
REPORT = "sft_report.json"


def _load_cfg(base_config: str, task: str, seed: int, output_dir: str, overrides=()):
    from gspo_megatron.config.loader import load_config

    return load_config(
        base_config, [f"output_dir={output_dir}", f"seed={seed}", f"data.task={task}", "data.path=null", *overrides]
    )


def _examples(rows, tokenizer) -> list[tuple[list[int], int]]:
    """(prompt ids + answer ids + end-of-turn id, prompt length) of each dataset row."""
    eos = tokenizer.eos_token_id
    out = []
    for r in rows:
        answer = tokenizer.encode(str(r.label), add_special_tokens=False)
        out.append((list(r.prompt_ids) + list(answer) + [eos], len(r.prompt_ids)))
    return out


def _batch(items, pad_id: int):
    """Right-padded ids, attention mask and labels (-100 but on the answer and end-of-turn tokens)."""
    width = max(len(t) for t, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for i, (t, p) in enumerate(items):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
        labels[i, p : len(t)] = torch.tensor(t[p:])
    return ids, mask, labels


@torch.no_grad()
def greedy_eval(model, tokenizer, rows, task: str, max_new_tokens: int | None = None) -> dict:
    """Greedy decoding (argmax, no cache: the model is tiny) of ``rows`` (``PromptRow``s), batched by prompt
    length. Returns ``accuracy`` (the response is exactly the label's tokens then the end-of-turn token),
    ``reward`` (the task's mean reward of the response, the end-of-turn token dropped) and ``n``."""
    from gspo_megatron.data.tasks import get_task

    t = get_task(task)
    eos = tokenizer.eos_token_id
    max_new = max_new_tokens or t.max_new_tokens
    by_len: dict[int, list] = {}
    for r in rows:
        by_len.setdefault(len(r.prompt_ids), []).append(r)
    model.eval()
    correct, reward = 0, 0.0
    for group in by_len.values():
        x = torch.tensor([list(r.prompt_ids) for r in group], dtype=torch.long)
        done = torch.zeros(len(group), dtype=torch.bool)
        outs: list[list[int]] = [[] for _ in group]
        for _ in range(max_new):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1)
            for i, tok in enumerate(nxt.tolist()):
                if not done[i]:
                    outs[i].append(tok)
            done |= nxt == eos
            if bool(done.all()):
                break
            x = torch.cat([x, nxt[:, None]], dim=1)
        for r, out in zip(group, outs):
            target = tokenizer.encode(str(r.label), add_special_tokens=False) + [eos]
            correct += out == target
            text_ids = out[:-1] if out and out[-1] == eos else out
            text = tokenizer.decode(text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            reward += t.reward(r.prompt, text, r.label)
    n = max(1, len(rows))
    return {"accuracy": correct / n, "reward": reward / n, "n": len(rows)}


def sft_teacher(
    out_dir: str,
    *,
    task: str = "last_digit",
    steps: int = 200,
    seed: int = 0,
    base_config: str = DEMO_CONFIG,
    lr: float = 3e-3,
    batch_size: int = 64,
    eval_rows: int = 256,
    overrides: tuple[str, ...] = (),
) -> str:
    """Write a teacher for ``task`` to ``out_dir`` (module docstring) and return ``out_dir``. The model's
    architecture is ``base_config``'s (with ``overrides``); its random init and its training are
    functions of ``seed``. ``<out_dir>/sft_report.json``: greedy ``accuracy`` / ``reward`` on ``eval_rows``
    held-out rows, ``held_out``, the final ``loss``, ``seconds``, the settings."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from gspo_megatron import factory

    t0 = time.time()
    work = tempfile.mkdtemp(prefix="sft-teacher-")
    try:
        cfg = _load_cfg(base_config, task, seed, work, overrides)
        init_dir = factory.hf_init_dir(cfg)  # the demo's random init (under ``seed``) + the demo tokenizer
        tokenizer = factory.build_tokenizer(init_dir)
        train_rows = list(factory.build_dataset(cfg, tokenizer))
        seen = {r.prompt for r in train_rows}
        eval_all = list(factory.build_dataset(dataclasses.replace(cfg, seed=seed + 1), tokenizer))
        eval_set = [r for r in eval_all if r.prompt not in seen]
        held_out = len(eval_set) >= min(16, eval_rows)
        eval_set = (eval_set if held_out else eval_all)[:eval_rows]

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same bits whatever the thread count (the model is tiny: no loss)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
                model.train()
                examples = _examples(train_rows, tokenizer)
                opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
                warm = max(1, steps // 10)
                sched = torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1.0 - s / max(1, steps))
                )
                rng = random.Random(f"sft-teacher:{seed}")
                loss_v = float("nan")
                for _ in range(steps):
                    ids, mask, labels = _batch(
                        rng.sample(examples, min(batch_size, len(examples))), tokenizer.pad_token_id
                    )
                    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
                    )
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    loss_v = float(loss.detach())
            train_s = time.time() - t0
            ev = greedy_eval(model, tokenizer, eval_set, task)
            tmp = out_dir.rstrip("/") + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
        finally:
            torch.set_num_threads(threads)
            if bar:
                hf_logging.enable_progress_bar()
        # the student's tokenizer files, as factory wrote them next to the init weights
        for name in os.listdir(init_dir):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(os.path.join(init_dir, name), tmp)
        report = {
            "task": task,
            "seed": seed,
            "steps": steps,
            "lr": lr,
            "batch_size": batch_size,
            "loss": loss_v,
            "held_out": held_out,
            **ev,
            "train_seconds": train_s,
            "seconds": time.time() - t0,
        }
        with open(os.path.join(tmp, REPORT), "w") as f:
            json.dump(report, f, indent=1)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def read_report(teacher_dir: str) -> dict:
    """The ``sft_report.json`` that :func:`sft_teacher` wrote."""
    with open(os.path.join(teacher_dir, REPORT)) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the teacher's HF directory (replaced)")
    p.add_argument("--task", default="last_digit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--config", default=DEMO_CONFIG, help="the student's config (its model.* gives the architecture)")
    a = p.parse_args(argv)
    out = sft_teacher(
        a.out, task=a.task, steps=a.steps, seed=a.seed, base_config=a.config, lr=a.lr, batch_size=a.batch_size
    )
    r = read_report(out)
    where = "held-out" if r["held_out"] else "(not held-out: the task has too few prompts)"
    print(
        f"teacher {out}: task {r['task']}, {r['steps']} SFT steps in {r['train_seconds']:.1f} s, final loss "
        f"{r['loss']:.4f}; greedy accuracy {r['accuracy']:.3f} (reward {r['reward']:.3f}) on {r['n']} {where} rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
