"""The step's data path (`StepSource`) and the trainer's own checkpoint state (`Trainer.state_dict`).

One process, no process group (`rank0_result` and `FailureCheck` then decide locally). The source
runs against a recorder of the few `Trainer` members it uses, which logs each plan fetch (a
collective in a real run) and each load, so the order the two load modes promise is checked
directly: on GPUs the next step's plan and load start right after this step's data wait; on CPU
the step loads its own samples in `next` and the next plan is fetched only after the update. The
whole loop with real trainers is tests/runtime/test_trainer_loop.py, test_skipping.py and test_trace.py.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from dflop.data.training import LoadedSample
from dflop.models.builder import build_model
from dflop.plan import Layout, Plan
from dflop.runtime.checkpoint import TrainState, load_latest, save_checkpoint
from dflop.runtime.param_names import rank_parameters
from dflop.runtime.skipping import SkippedSamples, replacement_rows
from dflop.runtime.spans import SpanRecorder
from dflop.runtime.step_source import StepSource
from dflop.runtime.topology import Topology
from dflop.runtime.trainer import Trainer
from dflop.scheduler.correction import AdaptiveCorrection
from dflop.scheduler.online import StepPlan
from test_checkpoint_helpers import LLAVA, make_state

N_POOL, SEED = 12, 3


def _plan(step: int, rows) -> StepPlan:
    rows = tuple(int(r) for r in rows)
    n = len(rows)
    return StepPlan(step=step, rows=rows, n_tiles=(0,) * n, seq_len=(1,) * n, feature_rows=(0,) * n,
                    bins=((tuple(range(n)),),), vision_shares=(((),),), microbatch_ids=(0,))


class _Recorder:
    """What a StepSource uses of a one-rank `Trainer`; `log` holds ("plan" | "load", step) in call order.
    Step s's batch is pool rows 4s .. 4s + 3; rows in `unreadable` load with an error."""

    def __init__(self, device: str, unreadable=()):
        self.device, self.unreadable, self.log = torch.device(device), set(unreadable), []
        self.spans = SpanRecorder()
        self.topo = Topology(Plan.uniform(Layout("colocated", 1, 1, 1, 1, 1, 1, 1), 2, 2), 0, 1)
        self.pool = pd.DataFrame({"dataset": ["demo"] * N_POOL, "sample_id": [f"s{i}" for i in range(N_POOL)]})
        self.skipped = SkippedSamples.for_pool(N_POOL, 0.5)
        self.settings = SimpleNamespace(seed=SEED)
        self.planner = SimpleNamespace(replan=lambda plan, rows: _plan(plan.step, rows))

    def next_plan(self, step: int) -> StepPlan:
        self.log.append(("plan", step))
        return _plan(step, range(4 * step, 4 * step + 4))

    def load(self, plan: StepPlan) -> Future:
        self.log.append(("load", plan.step))
        done = Future()
        done.set_result({row: LoadedSample(row, load_s=1e-3, error=f"sample demo/s{row}: unreadable"
                                           if row in self.unreadable else None) for row in plan.rows})
        return done


def _run(trainer: _Recorder, start: int, last: int) -> list:
    """The loop's calls on the source, logged among the trainer's; returns the batches."""
    source, batches = StepSource(trainer, start, last), []
    for step in range(start, last):
        trainer.log.append(("next", step))
        batches.append(source.next(step))
        trainer.log.append(("update", step))
        source.after_update(step)
    return batches


def test_on_gpus_the_next_step_is_planned_and_loaded_behind_this_one():
    trainer = _Recorder("cuda")  # a device name only: nothing runs on it here
    batches = _run(trainer, 1, 3)
    assert trainer.log == [("plan", 1), ("load", 1),
                           ("next", 1), ("plan", 2), ("load", 2), ("update", 1),
                           ("next", 2), ("update", 2)]
    assert [b.plan.rows for b in batches] == [(4, 5, 6, 7), (8, 9, 10, 11)]
    assert all(b.check is None and b.decode_s is None and b.skipped == 0 for b in batches)


def test_on_cpu_each_step_loads_its_own_and_plans_the_next_after_its_update():
    trainer = _Recorder("cpu")
    batches = _run(trainer, 0, 3)
    assert trainer.log == [("plan", 0),
                           ("next", 0), ("load", 0), ("update", 0), ("plan", 1),
                           ("next", 1), ("load", 1), ("update", 1), ("plan", 2),
                           ("next", 2), ("load", 2), ("update", 2)]
    for batch in batches:  # the agreement started, the loads charged to the forward of their position
        assert batch.check is not None and not batch.check.failed_here
        assert batch.decode_s.tolist() == pytest.approx([4e-3])


def test_a_step_out_of_order_is_refused():
    source = StepSource(_Recorder("cpu"), 0, 2)
    with pytest.raises(ValueError, match="step 1 asked, but the next step is 0"):
        source.next(1)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_sample_that_fails_is_replaced_as_the_skipping_protocol_says(device):
    """GPU: `next` hands out the batch already replaced; CPU: the trainer computes, learns of the
    failure and asks `replace_failed`. Either way the same replacement, counted once."""
    trainer = _Recorder(device, unreadable={5})
    source = StepSource(trainer, 1, 2)
    batch = source.next(1)
    if device == "cpu":
        assert batch.check.failed_here and batch.skipped == 0 and batch.plan.rows == (4, 5, 6, 7)
        batch = source.replace_failed(batch)
        assert batch.decode_s is not None
    expected = replacement_rows(N_POOL, [4, 5, 6, 7], [1], {5}, seed=SEED, step=1)
    assert batch.plan.rows == tuple(expected.tolist()) and 5 not in batch.plan.rows
    assert batch.check is None and batch.skipped == 1 and trainer.skipped.rows == {5}
    assert set(batch.loaded) == set(batch.plan.rows)


# -- the trainer's own state: the JSON train_state.json held as "extra" before it was Stateful --------


def _trainer_state(planner, skipped: SkippedSamples) -> SimpleNamespace:
    """A `Trainer`'s members its state_dict / load_state_dict read (building one takes a process group)."""
    return SimpleNamespace(planner=planner, skipped=skipped)


def test_trainer_state_is_the_extra_json_of_before_and_loads_it_back():
    correction = AdaptiveCorrection(6)
    correction.observe_step(1.0, 0.5)  # learned something: a fresh correction would not show a lost load
    skipped = SkippedSamples.for_pool(20, 0.5)
    skipped.add([7, 3], "sample demo/x: unreadable")
    owner = _trainer_state(SimpleNamespace(correction=correction), skipped)
    # What the code before the Stateful trainer wrote (Trainer.train_state's extra), key order included.
    before = {"correction": correction.state_dict()}
    before["skipped"] = skipped.state_dict()
    assert json.dumps(Trainer.state_dict(owner)) == json.dumps(before)
    assert Trainer.state_dict(_trainer_state(None, skipped)) == {"skipped": {"rows": [3, 7]}}  # ranks > 0

    fresh = _trainer_state(SimpleNamespace(correction=AdaptiveCorrection(6)), SkippedSamples.for_pool(20, 0.5))
    Trainer.load_state_dict(fresh, json.loads(json.dumps(before)))
    assert fresh.skipped.rows == {3, 7}
    assert fresh.planner.correction.state_dict() == correction.state_dict()


def test_a_stateful_extra_is_saved_as_train_state_json_extra_and_reads_a_dict_one(tmp_path):
    """The checkpoint keeps one on-disk layout: a checkpoint written with a dict extra (as the
    trainer did before) restores a Stateful extra, and a Stateful one is read back as that dict."""
    class Counters:
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"skipped": {"rows": self.value}}

        def load_state_dict(self, state):
            self.value = state["skipped"]["rows"]

    params = rank_parameters(build_model(*LLAVA, seed=0))
    old = make_state(params)
    old.extra.update({"skipped": {"rows": [4, 2]}})
    path = save_checkpoint(tmp_path / "old", 1, old)
    stateful = TrainState(params, old.optimizer, old.lr_scheduler, extra=Counters(None))
    assert load_latest(tmp_path / "old", stateful) == 1 and stateful.extra.value == [4, 2]

    save_checkpoint(tmp_path / "new", 1, TrainState(params, old.optimizer, old.lr_scheduler, extra=Counters([9])))
    record = json.loads((tmp_path / "new" / "step_000001" / "train_state.json").read_text())
    assert record["extra"] == {"skipped": {"rows": [9]}}
    assert record.keys() == json.loads((path / "train_state.json").read_text()).keys()
    plain = make_state(params)
    assert load_latest(tmp_path / "new", plain) == 1 and plain.extra == {"skipped": {"rows": [9]}}
