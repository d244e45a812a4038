"""Run gspo-train (``gspo_megatron.train.main``) in this process with one fault injected or one thing
observed, for the end-to-end tests of paths a healthy demo run never takes.

    python tests/train/run_driver.py MODE REPORT.json -- [gspo-train arguments]

MODE:
- ``observe``: record every model ``factory.build_model`` returns; when the rollout session is
  created (every weight loaded, nothing trained yet) snapshot them; at the end report whether the
  reference model (the second model built) moved, whether it started equal to the policy, and
  whether the policy moved; also the names of the policy's parameters that moved.
- ``nan_loss_from=N``: from the N-th call of ``train_on_batch`` on, every micro-batch's loss is NaN
  (so the gradient norm is non-finite and the update is skipped), as a diverging run would be.
- ``engine_raises_at=N``: the N-th ``HFRolloutEngine.generate`` call raises, the engine staying
  healthy (``health_check`` is True), as a bad request would.

- ``sync_raises_at=K``: during the K-th weight sync the engine's weight update raises after the
  first tensor of the sync's first bucket was loaded (a transport failing mid-sync), the engine staying healthy.
- ``engine_corrupts_from=K``: from the K-th weight sync on, the engine loads one MLP weight as zeros
  (an engine that does not hold the trainer's weights; only ``rollout.sync_verify`` can tell).
- ``session_composed``: snapshot the ``RolloutSession``'s instance attributes when its constructor
  returns, and at the end report every attribute added, removed or (a callable) replaced since, and
  every instance attribute that shadows a class attribute (a method replaced on the instance).

The report (JSON) is written even when the run raises: {"exit": code or the exception's text, ...}.
Only wrappers are installed; every code path of the run is the product's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)


def _observe(report: dict) -> callable:
    import torch

    from gspo_megatron import factory
    from gspo_megatron.orchestration import session as session_mod

    models, snaps = [], []
    build = factory.build_model

    def build_model(cfg, hf):
        model = build(cfg, hf)
        models.append(model)
        return model

    class ObservedSession(session_mod.RolloutSession):
        def __init__(self, *a, **k):
            snaps.extend({n: p.detach().clone() for n, p in m.named_parameters()} for m in models)
            super().__init__(*a, **k)

    factory.build_model = build_model
    session_mod.RolloutSession = ObservedSession

    def finish():
        def same(a: dict, b: dict) -> bool:
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

        now = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
        report.update(models_built=len(models))
        if models and snaps:  # the policy's parameters that moved (LoRA: only the adapters)
            report.update(
                policy_changed=sorted(n for n in snaps[0] if not torch.equal(now[0][n], snaps[0][n])),
                policy_params=len(snaps[0]),
            )
        if len(models) >= 2 and len(snaps) >= 2:
            report.update(
                ref_unchanged=same(now[1], snaps[1]),
                ref_started_as_policy=same(snaps[0], snaps[1]),
                policy_moved=not same(now[0], snaps[0]),
            )

    return finish


def _nan_loss_from(n: int, report: dict) -> callable:
    from gspo_megatron.trainer import step as train_step

    calls = {"train_on_batch": 0}
    make_loss, train_on_batch = train_step.make_megatron_loss_func, train_step.train_on_batch

    def poisoned_train_on_batch(*a, **k):
        calls["train_on_batch"] += 1
        return train_on_batch(*a, **k)

    def make_megatron_loss_func(*a, **k):
        loss_func = make_loss(*a, **k)
        if calls["train_on_batch"] < n:
            return loss_func

        def nan_loss(output_tensor, **kw):  # (kw: the fused head's output_weight)
            loss, *rest = loss_func(output_tensor, **kw)
            return (loss * float("nan"), *rest)

        return nan_loss

    train_step.train_on_batch = poisoned_train_on_batch
    train_step.make_megatron_loss_func = make_megatron_loss_func
    return lambda: report.update(train_on_batch_calls=calls["train_on_batch"])


def _engine_raises_at(n: int, report: dict) -> callable:
    from gspo_megatron.engines.hf_engine import HFRolloutEngine

    calls = {"generate": 0}
    generate = HFRolloutEngine.generate

    def failing_generate(self, *a, **k):
        calls["generate"] += 1
        if calls["generate"] == n:
            raise RuntimeError("injected: generate rejected the request")
        return generate(self, *a, **k)

    HFRolloutEngine.generate = failing_generate
    return lambda: report.update(generate_calls=calls["generate"])


def _sync_raises_at(k: int, report: dict) -> callable:
    from gspo_megatron.engines.hf_engine import HFRolloutEngine

    calls = {"syncs": 0, "raised": 0}
    begin, update = HFRolloutEngine.begin_weight_update, HFRolloutEngine.update_weights

    def counting_begin(self, *a, **kw):
        calls["syncs"] += 1
        return begin(self, *a, **kw)

    def failing_update(self, bucket):
        if calls["syncs"] == k and not calls["raised"]:
            update(self, list(bucket)[:1])  # part of the update landed: the failure is mid-sync
            calls["raised"] += 1
            raise RuntimeError("injected: weight update failed mid-sync")
        return update(self, bucket)

    HFRolloutEngine.begin_weight_update = counting_begin
    HFRolloutEngine.update_weights = failing_update
    return lambda: report.update(syncs=calls["syncs"], raised=calls["raised"])


def _engine_corrupts_from(k: int, report: dict) -> callable:
    from gspo_megatron.engines.hf_engine import HFRolloutEngine

    calls = {"syncs": 0, "corrupted": []}
    begin, update = HFRolloutEngine.begin_weight_update, HFRolloutEngine.update_weights

    def counting_begin(self, *a, **kw):
        calls["syncs"] += 1
        return begin(self, *a, **kw)

    def corrupting_update(self, bucket):
        if calls["syncs"] >= k:
            out = []
            for name, t in bucket:
                if "mlp" in name and not calls["corrupted"]:
                    calls["corrupted"].append(name)
                    t = t * 0
                elif calls["corrupted"] and name == calls["corrupted"][0]:
                    t = t * 0
                out.append((name, t))
            bucket = out
        return update(self, bucket)

    HFRolloutEngine.begin_weight_update = counting_begin
    HFRolloutEngine.update_weights = corrupting_update
    return lambda: report.update(syncs=calls["syncs"], corrupted=calls["corrupted"])


def _session_composed(report: dict) -> callable:
    from gspo_megatron.orchestration import session as session_mod

    seen: list = []

    class ComposedSession(session_mod.RolloutSession):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append((self, dict(vars(self))))

    session_mod.RolloutSession = ComposedSession

    def finish():
        report.update(sessions=len(seen), added=[], removed=[], replaced=[], shadows=[])
        for session, at_init in seen:
            now = vars(session)
            report["added"] += sorted(set(now) - set(at_init))
            report["removed"] += sorted(set(at_init) - set(now))
            report["replaced"] += sorted(
                k
                for k in set(now) & set(at_init)
                if (callable(now[k]) or callable(at_init[k])) and now[k] is not at_init[k]
            )
            report["shadows"] += sorted(k for k in now if hasattr(session_mod.RolloutSession, k))
            report["callables"] = sorted(k for k in now if callable(now[k]))

    return finish


def main() -> int:
    mode, report_path, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: run_driver.py MODE REPORT.json -- [gspo-train arguments]"
    report: dict = {"mode": mode}
    name, _, value = mode.partition("=")
    finish = {
        "observe": lambda: _observe(report),
        "nan_loss_from": lambda: _nan_loss_from(int(value), report),
        "engine_raises_at": lambda: _engine_raises_at(int(value), report),
        "sync_raises_at": lambda: _sync_raises_at(int(value), report),
        "engine_corrupts_from": lambda: _engine_corrupts_from(int(value), report),
        "session_composed": lambda: _session_composed(report),
    }[name]()
    from gspo_megatron.train import main as train_main

    try:
        code = train_main(argv)
        report["exit"] = code
        return code
    except BaseException as e:  # noqa: BLE001 - written to the driver's report
        report["exit"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        return 1
    finally:
        finish()
        with open(report_path, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    sys.exit(main())
