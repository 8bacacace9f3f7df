"""Checkpoints: resume after a real crash equals an uninterrupted run; 4 devices restore onto 2; every/keep; errors.

Exact equality (rtol 0, atol 0) where the resumed run executes the same programs
as the uninterrupted one; the float32 tolerance (rtol 1e-5, atol 1e-6) where the
device count changes, since the all-reduce then sums in another order.
"""

from __future__ import annotations

import shutil
import signal
import textwrap

import numpy as np
import optax
import pytest
from helpers import run_python, tree_allclose

import parallelkit as pk

STEPS, BATCH, LR = 10, 64, 1e-2


def batches(digits, steps=STEPS):
    """The run's data, made anew for every run: same seed, same order."""
    return pk.data.batches(digits, BATCH, steps=steps)


_REFERENCES: dict = {}


def uninterrupted(make, mlp, digits, steps=STEPS, tx=("adam", LR)):
    """(params, opt_state, losses) of an uninterrupted run, host copies; each computed once per module."""
    key = (repr(make()), steps, tx)
    if key not in _REFERENCES:
        loss_fn, params = mlp
        strategy = make()
        run = pk.fit(strategy, loss_fn, params, getattr(optax, tx[0])(tx[1]), batches(digits, steps))
        _REFERENCES[key] = (run.params, strategy.unreplicate(run.state.opt_state), run.history.losses)
    return _REFERENCES[key]


def uninterrupted_sgd(mlp, digits, steps=STEPS):
    return uninterrupted(pk.SingleDevice, mlp, digits, steps, tx=("sgd", 0.1))[0]


class CrashAt(pk.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, record):
        if record.step == self.step:
            raise RuntimeError(f"crash at step {record.step}")


# A run that is SIGKILLed after step 7: no cleanup, no final checkpoint, as when a machine dies.
CRASHING_RUN = textwrap.dedent(
    """
    import os, signal, sys
    import optax

    class Kill(pk.Callback):
        def on_step_end(self, record):
            if record.step == 7:
                os.kill(os.getpid(), signal.SIGKILL)

    dataset = pk.data.digits()
    apply, params = pk.models.build("mlp", dataset.input_shape, dataset.num_classes)
    pk.fit(pk.Mirrored(4), pk.models.classifier_loss(apply), params, optax.adam(1e-2),
           pk.data.batches(dataset, 64, steps=10), callbacks=[Kill()],
           checkpoint_dir=sys.argv[1], checkpoint_every=2, checkpoint_keep=2)
    print("not reached")
    """
)


@pytest.mark.timeout(120)
def test_resume_after_a_killed_process_equals_an_uninterrupted_run(mlp, digits, tmp_path):
    crashed = run_python(CRASHING_RUN, devices=4, timeout=100, args=(str(tmp_path),))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "not reached" not in crashed.stdout
    assert pk.checkpoint.Checkpoints(tmp_path).steps() == [4, 6]  # every 2, keep 2; step 7 was lost

    loss_fn, params = mlp
    strategy = pk.Mirrored(4)
    resumed = pk.fit(
        strategy, loss_fn, params, optax.adam(LR), batches(digits), checkpoint_dir=tmp_path, checkpoint_every=2,
        resume=True,
    )  # fmt: skip
    assert resumed.resumed_from == 6
    assert len(resumed.history.records) == STEPS - 6  # steps 7..10 only: the first six batches were skipped
    assert int(strategy.unreplicate(resumed.state.step)) == STEPS

    params, opt_state, losses = uninterrupted(lambda: pk.Mirrored(4), mlp, digits)
    tree_allclose(resumed.params, params, rtol=0, atol=0)
    tree_allclose(strategy.unreplicate(resumed.state.opt_state), opt_state, rtol=0, atol=0)
    np.testing.assert_array_equal(resumed.history.losses, losses[6:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make",
    [lambda: pk.Mirrored(2, backend="pmap"), lambda: pk.ParameterServer(2, devices=2), lambda: pk.CentralStorage(2)],
    ids=["mirrored-pmap", "parameter-server", "central-storage"],
)
def test_resume_after_an_exception_equals_an_uninterrupted_run(make, mlp, digits, tmp_path):
    loss_fn, params = mlp
    strategy = make()
    with pytest.raises(RuntimeError, match="crash at step 5") as raised:
        pk.fit(strategy, loss_fn, params, optax.adam(LR), batches(digits), callbacks=[CrashAt(5)],
               checkpoint_dir=tmp_path, checkpoint_every=3)  # fmt: skip
    # The callback failed after step 5 completed: that state is saved too, and handed over with the error.
    assert pk.checkpoint.Checkpoints(tmp_path).steps() == [3, 5]
    assert "stopped after 5 completed steps" in "".join(raised.value.__notes__)
    kept = raised.value.fit_result
    assert kept.interrupted and len(kept.history.records) == 5
    resumed = pk.fit(strategy, loss_fn, params, optax.adam(LR), batches(digits), checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 5 and len(resumed.history.records) == STEPS - 5
    tree_allclose(resumed.params, uninterrupted(make, mlp, digits)[0], rtol=0, atol=0)
    # The state in the exception is usable as it is: continuing from it ends on the same parameters.
    continued = pk.fit(strategy, loss_fn, params, optax.adam(LR), list(batches(digits))[5:], state=kept.state)
    tree_allclose(continued.params, uninterrupted(make, mlp, digits)[0], rtol=0, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make", [pk.SingleDevice, lambda: pk.Mirrored(2, backend="pmap"), lambda: pk.CentralStorage(2)],
    ids=["single", "mirrored-pmap", "central-storage"],
)  # fmt: skip
def test_a_resumed_float16_run_continues_with_its_loss_scale(make, mlp, digits, tmp_path):
    """The dynamic loss scale is checkpointed: a run resumed after step 5 ends where an uninterrupted one does.

    The scale starts far too high (the first steps overflow and halve it) and doubles after every
    2 finite steps, so it changes throughout: a resumed run that restarted it would skip other steps.
    """
    loss_fn, params = mlp
    fp16 = pk.Precision.fp16(period=2, initial_scale=2.0**24)
    whole = pk.fit(make(), loss_fn, params, optax.adam(LR), batches(digits), precision=fp16)
    with pytest.raises(RuntimeError, match="crash at step 5"):
        pk.fit(make(), loss_fn, params, optax.adam(LR), batches(digits), callbacks=[CrashAt(5)],
               checkpoint_dir=tmp_path, checkpoint_every=5, precision=fp16)  # fmt: skip
    strategy = make()
    resumed = pk.fit(strategy, loss_fn, params, optax.adam(LR), batches(digits), checkpoint_dir=tmp_path,
                     resume=True, precision=fp16)  # fmt: skip
    assert resumed.resumed_from == 5
    scales = [whole.history.metric("loss_scale"), resumed.history.metric("loss_scale")]
    np.testing.assert_array_equal(scales[1], scales[0][5:])
    assert len(set(scales[0][:5].tolist())) > 1  # the scale moved before the checkpoint: restoring it matters
    tree_allclose(resumed.params, whole.params, rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved_on_four(mlp, digits, tmp_path_factory):
    """A checkpoint after 5 steps of Mirrored on 4 devices, and those parameters."""
    loss_fn, params = mlp
    directory = tmp_path_factory.mktemp("four")
    run = pk.fit(pk.Mirrored(4), loss_fn, params, optax.adam(LR), batches(digits, 5), checkpoint_dir=directory)
    return directory, run.params


TARGETS = [lambda: pk.Mirrored(2), lambda: pk.Mirrored(2, backend="pmap"), pk.SingleDevice]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", TARGETS, ids=["mirrored-jit", "mirrored-pmap", "single"])
def test_checkpoint_saved_on_4_devices_restores_onto_fewer(make, saved_on_four, mlp, digits, tmp_path):
    loss_fn, params = mlp
    directory = shutil.copytree(saved_on_four[0], tmp_path / "ckpt")
    target = make()
    state = pk.checkpoint.restore(directory, target, params, optax.adam(LR))

    # The values are the saved ones, bit for bit ...
    tree_allclose(target.unreplicate(state.params), saved_on_four[1], rtol=0, atol=0)
    assert int(target.unreplicate(state.step)) == 5
    # ... and the placement is the target's: a full copy on each of its devices, and no others.
    for leaf in target.describe(state):
        assert leaf.copies == target.num_replicas
        assert leaf.devices == tuple(sorted(d.id for d in target.devices))
        if isinstance(target, pk.strategies.MirroredJit):
            assert leaf.spec == "P()" and len(leaf.devices) == 2

    # Training on from there ends where the 4-device run would have.
    resumed = pk.fit(target, loss_fn, params, optax.adam(LR), batches(digits), checkpoint_dir=directory, resume=True)
    assert resumed.resumed_from == 5
    tree_allclose(resumed.params, uninterrupted(lambda: pk.Mirrored(4), mlp, digits)[0])


@pytest.mark.timeout(60)
def test_every_k_steps_and_at_the_end_keeping_the_newest(mlp, digits, tmp_path):
    loss_fn, params = mlp
    kept, every = tmp_path / "keep2", tmp_path / "all"
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 7), checkpoint_dir=kept,
           checkpoint_every=2, checkpoint_keep=2)  # fmt: skip
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 7), checkpoint_dir=every,
           checkpoint_every=2, checkpoint_keep=None)  # fmt: skip
    assert pk.checkpoint.Checkpoints(kept).steps() == [6, 7]
    assert pk.checkpoint.Checkpoints(every).steps() == [2, 4, 6, 7]
    assert pk.checkpoint.latest_step(every) == 7
    # Each checkpoint holds the state after that step.
    four = pk.checkpoint.restore(every, pk.SingleDevice(), params, optax.sgd(0.1), step=4)
    tree_allclose(four.params, uninterrupted_sgd(mlp, digits, 4), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_interrupting_the_kernel_saves_the_state_so_far(mlp, digits, tmp_path):
    class Interrupt(pk.Callback):
        def on_step_end(self, record):
            if record.step == 3:
                raise KeyboardInterrupt

    loss_fn, params = mlp
    result = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits), callbacks=[Interrupt()],
                    checkpoint_dir=tmp_path)  # fmt: skip
    assert result.interrupted and pk.checkpoint.Checkpoints(tmp_path).steps() == [3]
    resumed = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits), checkpoint_dir=tmp_path,
                     resume=True)  # fmt: skip
    tree_allclose(resumed.params, uninterrupted_sgd(mlp, digits), rtol=0, atol=0)


def test_a_continued_run_counts_batches_not_steps(mlp, digits, tmp_path):
    """A run that starts from a given state (step 4) records the batches *it* consumed, for resuming."""
    loss_fn, params = mlp
    data = list(batches(digits))
    first = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data[:4])
    with pytest.raises(RuntimeError):
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data[4:], state=first.state,
               callbacks=[CrashAt(3)], checkpoint_dir=tmp_path, checkpoint_every=2)  # fmt: skip
    ckpt = pk.checkpoint.Checkpoints(tmp_path)
    assert ckpt.steps() == [6, 7]  # every 2 steps, and the last completed one when the callback failed
    assert ckpt.restore(pk.SingleDevice(), params, optax.sgd(0.1), step=6).batches == 2
    assert ckpt.restore(pk.SingleDevice(), params, optax.sgd(0.1)).batches == 3
    resumed = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data[4:], checkpoint_dir=tmp_path,
                     resume=True)  # fmt: skip
    tree_allclose(resumed.params, uninterrupted_sgd(mlp, digits), rtol=0, atol=0)


class TestErrors:
    def test_resume_needs_a_checkpoint_dir(self, mlp, digits):
        loss_fn, params = mlp
        with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits), resume=True)

    def test_resume_with_an_empty_directory_says_so(self, mlp, digits, tmp_path):
        loss_fn, params = mlp
        with pytest.raises(FileNotFoundError, match="holds no checkpoint yet"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits), resume=True,
                   checkpoint_dir=tmp_path / "missing")  # fmt: skip
        assert not (tmp_path / "missing").exists(), "looking for a checkpoint must not create the directory"
        with pytest.raises(FileNotFoundError, match="found steps: none"):
            pk.checkpoint.restore(tmp_path, pk.SingleDevice(), params, optax.sgd(0.1))

    def test_a_new_run_does_not_mix_with_an_earlier_runs_checkpoints(self, mlp, digits, tmp_path):
        loss_fn, params = mlp
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 2), checkpoint_dir=tmp_path)
        with pytest.raises(ValueError, match=r"already holds checkpoints \(steps \[2\]\).*resume=True"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 2), checkpoint_dir=tmp_path)

    def test_resume_and_state_exclude_each_other(self, mlp, digits, tmp_path):
        loss_fn, params = mlp
        state = pk.SingleDevice().init(params, optax.sgd(0.1))
        with pytest.raises(ValueError, match="not both"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits), state=state, resume=True,
                   checkpoint_dir=tmp_path)  # fmt: skip

    @pytest.mark.parametrize("options", [{"every": 0}, {"every": 2.5}, {"keep": 0}])
    def test_every_and_keep_must_be_positive_integers(self, options, tmp_path):
        with pytest.raises(ValueError, match="integer"):
            pk.checkpoint.Checkpoints(tmp_path, **options)

    def test_a_checkpoint_of_another_model_is_refused(self, mlp, digits, tmp_path):
        loss_fn, params = mlp
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 2), checkpoint_dir=tmp_path)
        _, other = pk.models.build("mlp", (4, 4, 1), digits.num_classes)  # another input size: other shapes
        with pytest.raises(ValueError, match="does not fit"):
            pk.checkpoint.restore(tmp_path, pk.SingleDevice(), other, optax.sgd(0.1))

    def test_an_async_parameter_server_refuses_checkpoints_before_training(self, mlp, digits, tmp_path):
        """Its workers' stale copies live outside the state: refused up front, not after the work."""
        loss_fn, params = mlp
        strategy = pk.ParameterServer(2, mode="async", devices=2)
        with pytest.raises(ValueError, match=r"could not resume it exactly.*mode='sync'"):
            pk.fit(strategy, loss_fn, params, optax.sgd(0.1), batches(digits, 2), checkpoint_dir=tmp_path)
        assert pk.checkpoint.latest_step(tmp_path) is None
        with pytest.raises(ValueError, match="could not resume it exactly"):
            pk.checkpoint.save(tmp_path, strategy.init(params, optax.sgd(0.1)), strategy)

    def test_too_few_batches_to_skip(self, mlp, digits, tmp_path):
        loss_fn, params = mlp
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 5), checkpoint_dir=tmp_path)
        with pytest.raises(ValueError, match="saved after 5 batches, but the batches given end after 3"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, 3), checkpoint_dir=tmp_path,
                   resume=True)  # fmt: skip


@pytest.mark.timeout(60)
def test_import_parallelkit_does_not_import_orbax():
    result = run_python(
        "import sys, parallelkit\nassert not [m for m in sys.modules if m.startswith('orbax')], 'orbax imported'",
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
