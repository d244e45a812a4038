"""Teachers this run starts (``distill.teachers`` entries 'NAME=HF_DIR'), on rank 0's node.

Each gets ``distill.engines_per_teacher`` servers of ``distill.teacher_tp`` GPUs, of the kind
``rollout.engine_server`` names (sglang, or the CPU stand-in ``gspo_megatron.cpu_server``), started with
``engines.sglang_engine.launch_server`` as the student's engines are. On GPUs they share the
training GPUs of rank 0's node (GPUs 0.. in order, ``distill.teacher_mem_fraction`` of each, sglang's
memory saver on): :meth:`StartedTeachers.release` frees their memory while the student trains and
:meth:`StartedTeachers.resume` takes it back before the next rollout (``orchestration.colocation``
calls both around the student's engines' own release and resume; not with the overlap or in-flight
updates, whose producer scores while the student trains). The CPU stand-in starts with the memory
saver too and keeps sglang's state rules, so a CPU run goes through the same release / resume. Logs:
``<output_dir>/teachers/``.
"""

from __future__ import annotations

import os
from typing import Any

from gspo_megatron.engines.sglang_client import SGLangHttpClient
from gspo_megatron.engines.sglang_engine import kill_server, launch_server, wait_until_healthy
from gspo_megatron.features.distill import TeacherSpec
from gspo_megatron.fleet.engine_fleet import SERVER_MODULES
from gspo_megatron.runtime.ports import free_port


class StartedTeachers:
    """The servers of the started teachers; ``urls[name]`` their URLs."""

    def __init__(self, cfg, specs: list[TeacherSpec]):
        d = cfg.distill
        self.kind = cfg.rollout.engine_server
        self.procs: list[Any] = []
        self.urls: dict[str, list[str]] = {}
        self.clients: list[SGLangHttpClient] = []
        self.released = False
        log_dir = os.path.join(cfg.output_dir, "teachers")
        os.makedirs(log_dir, exist_ok=True)
        gpu = 0
        try:
            for spec in specs:
                assert spec.model_path is not None  # a directory (preflight.check_teachers)
                self.urls[spec.name] = []
                for k in range(d.engines_per_teacher):
                    port = free_port()
                    args: dict[str, Any] = {
                        "model_path": spec.model_path,
                        "host": "127.0.0.1",
                        "port": port,
                        "tp_size": d.teacher_tp,
                        "base_gpu_id": gpu,
                        "mem_fraction_static": d.teacher_mem_fraction,
                        "skip_server_warmup": True,
                    }
                    if self.kind == "cpu":
                        args["dtype"] = "float32"  # the CPU stand-in scores in fp32 (exact against transformers)
                    args["enable_memory_saver"] = True  # released while the student trains,
                    args["enable_weights_cpu_backup"] = True  # its weights kept on the host (nothing syncs a teacher)
                    gpu += d.teacher_tp
                    log = os.path.join(log_dir, f"{spec.name}-{k}.log")
                    self.procs.append(launch_server(args, module=SERVER_MODULES[self.kind], log_path=log))
                    client = SGLangHttpClient(f"http://127.0.0.1:{port}", timeout_s=d.timeout_s)
                    self.clients.append(client)
                    self.urls[spec.name].append(client.base_url)
                    wait_until_healthy(client, self.procs[-1], cfg.rollout.engine_timeout_s, log)
        except BaseException:
            self.close()
            raise

    def release(self) -> None:
        """Free the teachers' memory while the student trains (sglang's memory saver; the CPU
        stand-in keeps sglang's state rules: nothing is scored on released memory). Idempotent."""
        if not self.released:
            for c in self.clients:
                c.release_memory_occupation()
            self.released = True

    def resume(self) -> None:
        """Take the memory back before the next rollout (nothing to do when not released)."""
        if self.released:
            for c in self.clients:
                c.resume_memory_occupation()
            self.released = False

    def close(self) -> None:
        for p in self.procs:
            kill_server(p)
        self.procs = []
