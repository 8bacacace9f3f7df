"""fit's callbacks: the hooks a user callback sees and their order, and the callbacks fit installs itself."""

from __future__ import annotations

import math

import optax
import pytest

import parallelkit as pk
from parallelkit.run.callbacks import Checkpointing, NonFiniteCheck


class Log(pk.Callback):
    """Writes every hook call, in order, to a shared list."""

    def __init__(self, name: str, events: list, fail_at: int | None = None):
        self.name, self.events, self.fail_at = name, events, fail_at

    def on_train_begin(self, info):
        self.events.append((self.name, "begin", info.steps))

    def on_step_end(self, record):
        self.events.append((self.name, "step", record.step))
        if record.step == self.fail_at:
            raise RuntimeError(f"{self.name} failed at step {record.step}")

    def on_train_error(self, history, error):
        self.events.append((self.name, "error", len(history.records), str(error)))

    def on_train_end(self, history, interrupted):
        self.events.append((self.name, "end", len(history.records), interrupted))


def test_user_callbacks_see_every_step_in_order(mlp, digits):
    loss_fn, params = mlp
    events: list = []
    result = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32), steps=4,
                    callbacks=[Log("a", events), Log("b", events)])  # fmt: skip
    steps = [e for i in range(1, 5) for e in (("a", "step", i), ("b", "step", i))]
    assert events == [("a", "begin", 4), ("b", "begin", 4), *steps, ("a", "end", 4, False), ("b", "end", 4, False)]
    assert [r.step for r in result.history.records] == [1, 2, 3, 4]


def test_a_callback_that_raises_stops_the_run_with_its_state(mlp, digits, tmp_path):
    loss_fn, params = mlp
    events: list = []
    with pytest.raises(RuntimeError, match="a failed at step 3") as raised:
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=6),
               callbacks=[Log("a", events, fail_at=3), Log("b", events)], checkpoint_dir=tmp_path,
               checkpoint_every=2)  # fmt: skip
    # The later callback never sees step 3; both are told of the error; neither hears of an end.
    assert events[-3:] == [
        ("a", "step", 3),
        ("a", "error", 3, "a failed at step 3"),
        ("b", "error", 3, "a failed at step 3"),
    ]
    kept = raised.value.fit_result
    assert kept.interrupted and len(kept.history.records) == 3 and int(kept.state.step) == 3
    assert pk.checkpoint.Checkpoints(tmp_path).steps() == [2, 3]  # every 2 steps, and the state handed over
    notes = "".join(raised.value.__notes__)
    assert "stopped after 3 completed steps" in notes and f"step 3 in {tmp_path}" in notes


def test_fit_checks_and_checkpoints_before_user_callbacks_see_a_step(mlp, digits, tmp_path):
    loss_fn, params = mlp
    seen: list = []

    class Watch(pk.Callback):
        def on_step_end(self, record):
            seen.append((record.step, pk.checkpoint.Checkpoints(tmp_path).latest_step()))

    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32), steps=4,
           callbacks=[Watch()], checkpoint_dir=tmp_path, checkpoint_every=2)  # fmt: skip
    assert seen == [(1, None), (2, 2), (3, 2), (4, 4)]

    huge = optax.sgd(1e30)  # step 2's loss is not finite: the user's callback never sees it
    seen.clear()
    with pytest.raises(pk.NonFiniteLossError, match="at step 2 of the run"):
        pk.fit(pk.SingleDevice(), loss_fn, params, huge, pk.data.batches(digits, 32, steps=4), callbacks=[Watch()],
               checkpoint_dir=tmp_path / "huge", checkpoint_every=1)  # fmt: skip
    assert [step for step, _ in seen] == [1]
    assert pk.checkpoint.Checkpoints(tmp_path / "huge").steps() == [1]  # the non-finite state is not saved


def test_non_finite_check_names_the_run_step():
    check = NonFiniteCheck(first=10)
    check.on_step_end(pk.StepRecord(1, {"loss": 1.0}, 0.1, compiled=True))
    with pytest.raises(pk.NonFiniteLossError, match="became inf at step 13 of the run"):
        check.on_step_end(pk.StepRecord(3, {"loss": math.inf}, 0.1, compiled=False))


class _FakeCheckpoints:
    """Records saves; due every ``every`` steps, as :class:`pk.checkpoint.Checkpoints` is."""

    directory = "ckpts"

    def __init__(self, every: int):
        self.every, self.saves = every, []

    def should_save(self, step):
        return step % self.every == 0

    def save(self, state, strategy, *, batches, force):
        self.saves.append((state, batches, force))


def test_checkpointing_saves_when_due_and_once_per_step():
    ckpt = _FakeCheckpoints(every=3)
    # A resumed run: its state was at step 3 (saved there) after 5 batches.
    cb = Checkpointing(ckpt, pk.SingleDevice(), lambda: "state", first=3, consumed=5, saved=3)
    for i in range(1, 5):
        cb.on_step_end(pk.StepRecord(i, {"loss": 1.0}, 0.1, compiled=i == 1))
    assert ckpt.saves == [("state", 8, False)]  # step 6 of the run
    history = pk.History([pk.StepRecord(i, {"loss": 1.0}, 0.1, compiled=i == 1) for i in range(1, 5)])
    cb.on_train_end(history, interrupted=False)
    assert ckpt.saves[-1] == ("state", 9, True) and cb.saved == 7
    error = RuntimeError("boom")
    cb.on_train_error(history, error)  # step 7 is saved already
    assert len(ckpt.saves) == 2 and error.__notes__ == ["The newest checkpoint is step 7 in ckpts."]
