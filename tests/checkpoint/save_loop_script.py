"""Saves checkpoints in a loop in a world of one (the kill -9 test kills it at a random moment).

    python save_loop_script.py HF_DIR CKPT_ROOT
Prints "saved <step>" after each completed save.
"""

import sys

if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing manager
    from gspo_megatron.checkpoint.manager import save_checkpoint
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    hf_dir, root = sys.argv[1], sys.argv[2]
    init_distributed(ParallelLayout())
    model = build_model(load_hf_config(hf_dir), opts=ModelOptions())
    load_hf_weights(model, hf_dir)
    for step in range(1, 1000):
        for p in model.parameters():
            p.data.fill_(float(step))  # the step is readable from any weight
        save_checkpoint(root, step, model, extra_state={"step": step}, keep_last=2)
        print(f"saved {step}", flush=True)
