"""Mutation evidence for issue 15 (scratch script, not part of the package).

    python mutate.py ID [ID ...]      # apply each mutation, run its test, restore (always)
    python mutate.py --list

Each mutation is a list of exact (file, old, new) replacements in product code (each `old` must
occur exactly once). The test is run with the shared venv, the worktree first on PYTHONPATH;
heavy tests under `flock /work/wt/heavy.lock` (or, with MUTATE_HOLDS_LOCK=1, the caller holds it
for a chunk of mutations: `flock /work/wt/heavy.lock env MUTATE_HOLDS_LOCK=1 python mutate.py A B C`). The file is restored with `git checkout -- FILE`
in a finally block, whatever happens. One JSON line per mutation goes to /tmp/mutation-results.jsonl:
{id, test, failed (bool), first_error (first 'E ' line or failure line), seconds}.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
PY = "/work/main/.venv/bin/python"
RESULTS = "/tmp/mutation-results.jsonl"

BF16_HOOK = '''    model.hf_config = hf  # the mapping and export read it back
    if config.bf16 and ps.is_pipeline_last_stage():  # MUTATION: one layer's MLP output zeroed
        def _zero(m, i, o):
            return (o[0] * 0, *o[1:]) if isinstance(o, tuple) else o * 0
        model.decoder.layers[0].mlp.register_forward_hook(_zero)
'''

M = {
    # --- weak tests ----------------------------------------------------------------------------------
    "cp_old_logprobs": dict(
        claim="CP split cuts old log-probs with the tokens",
        edits=[("gspo_megatron/pipeline.py",
                "{k: batch[k] for k in TOKEN_KEYS if k in batch}",
                "{k: batch[k] for k in TOKEN_KEYS if k in batch and k != 'old_logprobs'}")],
        test="tests/pipeline/test_context_parallel_split.py::test_split_and_gather_round_trip", heavy=True),
    "cp_positions_local": dict(
        claim="CP split keeps global positions",
        edits=[("gspo_megatron/pipeline.py",
                "    return {**batch, **local}\n\n\ndef gather_context_parallel",
                "    local['position_ids'] = torch.arange(local['position_ids'].shape[1]).expand_as(local['position_ids'])\n"
                "    return {**batch, **local}\n\n\ndef gather_context_parallel")],
        test="tests/pipeline/test_context_parallel_split.py::test_split_and_gather_round_trip", heavy=True),
    "reward_timeout_ignored": dict(
        claim="reward.timeout_s cuts a hanging reward call (counted, scored 0)",
        edits=[("gspo_megatron/factory.py", "num_workers=r.num_workers, timeout_s=r.timeout_s,",
                "num_workers=r.num_workers, timeout_s=600.0,")],
        test="tests/train/test_user_task.py::test_user_data_and_reward_function", heavy=True, timeout=240),
    "reward_timeout_not_counted": dict(
        claim="a reward timeout is counted in reward/timeouts",
        edits=[("gspo_megatron/rewards/outcomes.py",
                'stats["reward/timeouts" if status == "timeout" else "reward/errors"] += 1',
                'stats["reward/errors"] += 1')],
        test="tests/train/test_user_task.py::test_user_data_and_reward_function", heavy=True),
    "cli_traceback": dict(
        claim="a bad setting fails with one line, no traceback",
        edits=[("gspo_megatron/errors.py", "        if debug_requested(debug):\n            traceback",
                "        if True:\n            traceback")],
        test="tests/train/test_cli.py::test_bad_settings_fail_fast_naming_the_field"),
    "cli_slow": dict(
        claim="a bad setting fails before any model is built",
        edits=[("gspo_megatron/train.py", "        cfg = load_config(args.config, args.overrides)\n        check_before_start(cfg)",
                "        cfg = load_config(args.config, args.overrides)\n"
                "        from gspo_megatron import factory; factory.hf_init_dir(cfg)\n        check_before_start(cfg)")],
        test="tests/train/test_cli.py::test_bad_settings_fail_fast_naming_the_field"),
    "colocated_engine_tp": dict(
        claim="colocated engine_tp must divide the training GPUs (config accepts only what runs)",
        edits=[("gspo_megatron/config/validation.py", "        if world_size % r.engine_tp:",
                "        if False and world_size % r.engine_tp:")],
        test="tests/config/test_config_validation.py::test_colocated_engine_checks"),
    "loss_agg_token_sum": dict(
        claim="gspo.loss_agg=token-sum refused (was silently trained as seq-mean-token-mean)",
        edits=[("gspo_megatron/config/schema.py", 'loss_agg: Literal["seq-mean-token-mean", "token-mean"]',
                'loss_agg: Literal["seq-mean-token-mean", "token-mean", "token-sum"]')],
        test="tests/config/test_config_validation.py"),
    "offload_ignored": dict(
        claim="rollout.offload_train (the planner's 235B fit) is done by training",
        edits=[("gspo_megatron/train.py", "        offloader.offload()", "        pass  # offloader.offload()"),
               ("gspo_megatron/train.py", "        offloader.reload()", "        pass  # offloader.reload()")],
        test="tests/train/test_offload.py::test_loss_curve_identical_with_offload", heavy=True),
    # --- transports ---------------------------------------------------------------------------------------
    "ipc_serialize_drops_tensor": dict(
        claim="CUDA-IPC serialization round-trips every tensor",
        edits=[("gspo_megatron/weight_sync/cuda_ipc.py", "flat = cls(named_tensors=group)",
                "flat = cls(named_tensors=group[:-1] if len(group) > 1 else group)")],
        test="tests/weight_sync/test_transports_cpu.py::test_serialize_round_trip_mixed_dtypes"),
    "ipc_no_flattened_format": dict(
        claim="the engine is told the payload is SGLang's flattened_bucket",
        edits=[("gspo_megatron/weight_sync/cuda_ipc.py",
                'self.load_format = "flattened_bucket" if flattened_bucket_class() is not None else None',
                'self.load_format = None')],
        test="tests/weight_sync/test_transports_cpu.py::test_cuda_ipc_transport_single_rank_protocol"),
    "ipc_metadata_dropped": dict(
        claim="the flattened bucket's metadata travels with it",
        edits=[("gspo_megatron/weight_sync/cuda_ipc.py", '"metadata": flat.get_metadata()}',
                '"metadata": flat.get_metadata()[:-1]}')],
        test="tests/weight_sync/test_transports_cpu.py::test_serialize_round_trip_mixed_dtypes"),
    "ipc_rank0_payload_to_all": dict(
        claim="engine TP rank i gets training rank i's payload",
        edits=[("gspo_megatron/weight_sync/cuda_ipc.py", "[p[i] for p in gathered]",
                "[gathered[0][i] for p in gathered]")],
        test="tests/weight_sync/test_transports_cpu.py::test_cuda_ipc_gathers_one_payload_per_engine_tp_rank",
        heavy=True),
    # --- bf16 comparison ----------------------------------------------------------------------------------
    "bf16_layer_mlp_zeroed": dict(
        claim="the bf16 scorer comparison catches one broken layer",
        edits=[("gspo_megatron/models/build.py", "    model.hf_config = hf  # the mapping and export read it back\n",
                BF16_HOOK)],
        test="tests/models/test_equivalence.py::test_bf16_scorer_close_to_transformers", heavy=True, timeout=900),
    # --- production wiring (factory / topology / fleet) -----------------------------------------------
    "colocated_feeds_engine0": dict(
        claim="colocated sync feeds every engine (factory -> build_sync_topology)",
        edits=[("gspo_megatron/weight_sync/topology.py",
                "client = fleet.client(spec.index) if rank == spec.src_rank else None",
                "client = fleet.client(0) if rank == spec.src_rank else None")],
        test="tests/topology/test_multinode.py::test_colocated_two_engines_two_nodes_with_an_engine_killed",
        heavy=True, timeout=900),
    "disagg_one_source": dict(
        claim="disaggregated sync sends each stage from its own source",
        edits=[("gspo_megatron/weight_sync/topology.py",
                'SyncTopology("disaggregated", lambda owner: sources[stage_of[owner]], transport,',
                'SyncTopology("disaggregated", lambda owner: sources[0], transport,')],
        test="tests/topology/test_multinode.py::test_disaggregated_two_engines_per_stage_groups",
        heavy=True, timeout=900),
    "fleet_restart_no_launch": dict(
        claim="a dead engine is relaunched by the node that owns it",
        edits=[("gspo_megatron/rollout/engine_fleet.py",
                "        _barrier()  # every part of a multi-node engine is down before any is started again\n"
                "        self._launch(engines)",
                "        _barrier()  # every part of a multi-node engine is down before any is started again\n"
                "        pass  # self._launch(engines)")],
        test="tests/topology/test_multinode.py::test_colocated_two_engines_two_nodes_with_an_engine_killed",
        heavy=True, timeout=900),
    "fleet_attach_no_wait": dict(
        claim="attached engines (rollout.engine_urls): the trainer waits for them to answer",
        edits=[("gspo_megatron/rollout/engine_fleet.py",
                "                    wait_until_healthy(SGLangHttpClient(url), None, self.wait_s)",
                "                    pass  # wait_until_healthy(SGLangHttpClient(url), None, self.wait_s)")],
        test="tests/topology/test_attach.py::test_trainer_waits_for_an_attached_engine_then_syncs_and_trains",
        heavy=True, timeout=400, fixed="new test (tests/topology/test_attach.py)"),
    # --- paths CI never ran (run_paths) --------------------------------------------------------------
    "session_fatal_swallowed": dict(
        claim="RolloutSession stops the run on a fatal error",
        edits=[("gspo_megatron/rollout/session.py", '        if status[0] == "fatal":\n            raise RuntimeError(status[1])',
                '        if status[0] == "fatal":\n            print(status[1], flush=True)\n            return False')],
        test="tests/train/test_run_paths.py::test_a_healthy_engine_that_raises_stops_the_run", heavy=True),
    "session_restart_unbounded": dict(
        claim="an engine that keeps dying stops the run after rollout.max_engine_restarts",
        edits=[("gspo_megatron/rollout/session.py", "        if self.restarts > self.max_restarts:",
                "        if False and self.restarts > self.max_restarts:")],
        test="tests/train/test_run_paths.py::test_an_engine_that_keeps_dying_stops_the_run", heavy=True),
    "sync_failure_ignored": dict(
        claim="a transport failure mid-sync is not ignored",
        edits=[("gspo_megatron/weight_sync/sync.py", "        failed = any_rank(error is not None)",
                "        failed = any_rank(False)")],
        test="tests/train/test_run_paths.py::test_a_transport_failure_mid_sync_stops_the_run", heavy=True),
    "probe_accepts_anything": dict(
        claim="rollout.sync_verify catches an engine that does not hold the trainer's weights",
        edits=[("gspo_megatron/weight_sync/probe.py", "        ok = worst <= tol\n", "        ok = True\n")],
        test="tests/train/test_run_paths.py::test_sync_verify_stops_a_run_whose_engine_lost_a_tensor", heavy=True),
    "kl_ref_ignored": dict(
        claim="gspo.kl_coef > 0 uses the frozen reference model",
        edits=[("gspo_megatron/train.py", "ref_model=run.ref_model,", "ref_model=None,")],
        test="tests/train/test_run_paths.py::test_kl_reference_model_is_frozen_and_kl_grows_from_zero", heavy=True),
    "kl_ref_trains": dict(
        claim="the KL reference model stays frozen",
        edits=[("gspo_megatron/train.py", "        run.ref_model.requires_grad_(False)\n",
                "        run.ref_model = run.model\n")],
        test="tests/train/test_run_paths.py::test_kl_reference_model_is_frozen_and_kl_grows_from_zero", heavy=True),
    "model_checkpoint_ignored": dict(
        claim="model.checkpoint gives the starting weights",
        edits=[("gspo_megatron/train.py", "    elif cfg.model.checkpoint:\n", "    elif False:\n")],
        test="tests/train/test_run_paths.py::test_model_checkpoint_starts_from_a_previous_runs_weights", heavy=True),
    "max_bad_steps_ignored": dict(
        claim="optimizer.max_bad_steps stops a diverging run",
        edits=[("gspo_megatron/train.py", "    too_bad = run.bad_streak >= cfg.optimizer.max_bad_steps > 0",
                "    too_bad = False")],
        test="tests/train/test_run_paths.py::test_run_stops_after_max_bad_steps_with_the_last_good_checkpoint",
        heavy=True),
    "pretrained_ignored": dict(
        claim="model.init=pretrained starts from model.hf_path's weights",
        edits=[("gspo_megatron/factory.py", '    if cfg.model.init == "pretrained":\n',
                '    if False:\n')],
        test="tests/train/test_run_paths.py::test_pretrained_init_from_a_sharded_hf_checkpoint", heavy=True),
    "first_shard_only": dict(
        claim="a sharded safetensors checkpoint is read whole",
        edits=[("gspo_megatron/models/weights.py", '                self.where = json.load(f)["weight_map"]',
                '                w = json.load(f)["weight_map"]\n'
                '                self.where = {k: v for k, v in w.items() if v == min(w.values())}')],
        test="tests/train/test_run_paths.py::test_pretrained_init_from_a_sharded_hf_checkpoint", heavy=True),
    # --- checkpoint kill, harness deadline -------------------------------------------------------------
    "checkpoint_not_atomic": dict(
        claim="kill -9 during a save leaves the newest complete checkpoint loadable",
        edits=[("gspo_megatron/checkpoint.py", 'tmp_dir = f"{final_dir}.tmp-{uuid.uuid4().hex[:10]}"',
                'tmp_dir = final_dir  # MUTATION: written in place, complete-marker first\n'
                '        shutil.rmtree(final_dir, ignore_errors=True)'),
               ("gspo_megatron/checkpoint.py", "        os.makedirs(os.path.join(tmp_dir, DIST_SUBDIR))\n",
                "        os.makedirs(os.path.join(tmp_dir, DIST_SUBDIR))\n"
                "        open(os.path.join(tmp_dir, MARKER_FILE), 'w').write(f'{step}\\n')\n"),
               ("gspo_megatron/checkpoint.py", "    old = None\n    if os.path.exists(final_dir):",
                "    if tmp_dir == final_dir:\n        return\n    old = None\n    if os.path.exists(final_dir):")],
        test="tests/checkpoint/test_checkpoint_kill.py::test_kill_during_save_loop_leaves_a_loadable_checkpoint",
        heavy=True),
    "checkpoint_writers_orphaned": dict(
        claim="nothing of a saver killed during a save stays alive (Megatron's checkpoint writers)",
        edits=[("gspo_megatron/checkpoint.py", "    adopt_checkpoint_writers()  # Megatron's",
                "    pass  # adopt_checkpoint_writers()  # Megatron's")],
        test="tests/checkpoint/test_checkpoint_kill.py::test_kill_during_save_loop_leaves_a_loadable_checkpoint",
        heavy=True),
    "harness_no_deadline": dict(
        claim="a deadlocked multi-rank test fails with the ranks' stacks (no hang)",
        edits=[("tests/distributed_harness.py", "                if time.monotonic() > deadline:",
                "                if False and time.monotonic() > deadline:")],
        test="tests/test_distributed_harness.py::test_a_deadlock_fails_with_every_ranks_stacks_and_kills_them",
        heavy=True, timeout=150),
}


def apply(edits) -> list[str]:
    files = []
    for path, old, new in edits:
        full = os.path.join(ROOT, path)
        text = open(full).read()
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"{path}: the text to mutate occurs {n} times: {old!r}")
        open(full, "w").write(text.replace(old, new))
        files.append(path)
    return files


def first_error(out: str) -> str:
    for pat in (r"^E\s+(.*\S)", r"^FAILED .*? - (.*)", r"Timeout", r"^ERROR .*"):
        m = re.search(pat, out, re.M)
        if m:
            return (m.group(1) if m.groups() else m.group(0))[:300]
    return out.strip().splitlines()[-1][:300] if out.strip() else ""


def run(mid: str) -> dict:
    spec = M[mid]
    files: list[str] = []
    t0 = time.monotonic()
    try:
        if "checkpoint.py" in str(spec["edits"]) and "import shutil" not in open(os.path.join(ROOT, "gspo_megatron/checkpoint.py")).read():
            spec["edits"] = [("gspo_megatron/checkpoint.py", "import uuid\n", "import shutil\nimport uuid\n")] + spec["edits"]
        files = apply(spec["edits"])
        cmd = [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--timeout={spec.get('timeout', 600)}",
               f"--basetemp=/tmp/mutation-pt/{mid}", spec["test"]]
        if spec.get("heavy") and not os.environ.get("MUTATE_HOLDS_LOCK"):
            cmd = ["flock", "/work/wt/heavy.lock", *cmd]
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        os.makedirs("/tmp/mutation-logs", exist_ok=True)
        open(f"/tmp/mutation-logs/{mid}.log", "w").write(out)
        result = dict(id=mid, claim=spec["claim"], test=spec["test"], files=sorted(set(files)),
                      failed=proc.returncode != 0, rc=proc.returncode,
                      first_error=first_error(out) if proc.returncode else "",
                      summary=out.strip().splitlines()[-1][:200] if out.strip() else "",
                      seconds=round(time.monotonic() - t0))
    finally:
        for f in sorted(set(files)):
            subprocess.run(["git", "checkout", "--", f], cwd=ROOT, check=True)
    with open(RESULTS, "a") as fh:
        fh.write(json.dumps(result) + "\n")
    return result


def table() -> str:
    """The evidence table from RESULTS (the last result per mutation id)."""
    last = {}
    for line in open(RESULTS):
        r = json.loads(line)
        last[r["id"]] = r
    rows = ["| claim | test (file::name) | mutation (file, what changed) | result | fixed test? |",
            "|---|---|---|---|---|"]
    for mid, spec in M.items():
        if mid not in last:
            continue
        r = last[mid]
        what = "; ".join(f"`{old.strip()[:70]}` -> `{new.strip()[:70]}`" for _, old, new in spec["edits"]
                         if "import shutil" not in new)
        res = (f"failed ({r['seconds']} s): {r['first_error']}" if r["failed"] else f"PASSED ({r['summary']})")
        rows.append(f"| {spec['claim']} | `{spec['test']}` | {', '.join(r['files'])} [{mid}]: {what} | "
                    f"{res.replace('|', '/')} | {spec.get('fixed', '')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print(table())
        sys.exit(0)
    if sys.argv[1:] == ["--list"]:
        for k, v in M.items():
            print(f"{k:28s} {v['test']}")
        sys.exit(0)
    dirty = subprocess.run(["git", "status", "--porcelain", "gspo_megatron", "tests/distributed_harness.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if dirty:
        raise SystemExit(f"product code has uncommitted changes; commit or stash first:\n{dirty}")
    for mid in sys.argv[1:]:
        r = run(mid)
        print(json.dumps(r), flush=True)
