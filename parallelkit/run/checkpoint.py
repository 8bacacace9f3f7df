"""Checkpoints with orbax: save every K steps, keep the last N, restore onto any strategy's placement.

Holds :class:`Checkpoints` (one run's directory), :func:`save`, :func:`restore` and
:func:`latest_step`, and :func:`restore_or_check`, how ``fit`` resumes a run or refuses to
overwrite another's. A checkpoint holds a :class:`~parallelkit.TrainState`'s ``step``,
``params`` and ``opt_state`` (and its PRNG key and model state, when it has them) at their
*logical* shapes, plus how many batches the run had consumed; restoring takes
``strategy.init``'s arguments and gives its placement with the saved values::

    state = strategy.init(params, tx)                  # where every leaf should live
    state = load(directory, like=state)                # orbax reads each shard into place

So a checkpoint written by ``Mirrored`` on 4 devices restores onto ``Mirrored`` on 2, or onto
``SingleDevice``. Arrays placed by ``jax.jit`` shardings are written and read shard by shard,
by the process that holds them: on a cluster every process calls ``save`` and ``restore`` on a
directory all of them see, and the state must span every process (``MultiWorkerMirrored``).
``Mirrored(backend="pmap")``'s state is saved as one host copy and placed again on restore.
``orbax-checkpoint`` is imported when a checkpoint is first used, not by ``import parallelkit``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

from ..core.partition import path_label
from ..core.precision import LossScaleState
from ..core.state import TrainState
from ..core.types import PyTree, is_count
from ..strategies.base import Strategy

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

_STATE, _META = "state", "meta"  # the two items of every checkpoint


@dataclass(frozen=True)
class _Restored:
    """A restored, placed state; the step it was saved at; how many batches the run had consumed then."""

    state: TrainState
    step: int
    batches: int


def _state_tree(state: TrainState) -> dict[str, PyTree]:
    """What a checkpoint stores: step, parameters, optimizer state, and the PRNG key, model state and
    dynamic loss scale when present (the scale as a dict of its two arrays)."""
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    scale = state.loss_scale
    extras = {
        "rng": state.rng,
        "model_state": state.model_state,
        "loss_scale": None if scale is None else {"scale": scale.scale, "good_steps": scale.good_steps},
    }
    return tree | {name: value for name, value in extras.items() if value is not None}


def _like_step(state: TrainState, value: PyTree) -> PyTree:
    """Each leaf of ``value`` (host values, one copy) placed as the step counter is: its shape and sharding."""
    return jax.tree.map(
        lambda x: jax.device_put(np.full(state.step.shape, np.asarray(x).reshape(-1)[0]), state.step.sharding), value
    )


def _is_logical(strategy: Strategy, tree: PyTree) -> bool:
    """True when every leaf has its logical shape (no per-device stacking, as pmap does)."""
    return all(strategy.logical_shape(x) == tuple(x.shape) for x in jax.tree.leaves(tree))


def host_step(strategy: Strategy, state: TrainState) -> int:
    """The state's step counter as a Python int, whatever the strategy's layout."""
    return int(np.asarray(strategy.unreplicate(state.step)).reshape(-1)[0])


def _leaf_table(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params/head/kernel": (shape, dtype)}``: a tree's leaves, with paths as orbax's metadata spells them."""
    return {
        path_label(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


class Checkpoints:
    """A directory of checkpoints: saved every ``every`` steps, the last ``keep`` kept.

    >>> import tempfile
    >>> ckpt = Checkpoints(tempfile.mkdtemp(), every=5, keep=2)
    >>> ckpt.should_save(10), ckpt.should_save(11), ckpt.latest_step()
    (True, False, None)

    Args:
      directory: where checkpoints go, one subdirectory per step (created if missing).
      every: save at steps that are multiples of this (``save(..., force=True)`` saves any step).
      keep: how many of the newest checkpoints to keep; ``None`` keeps them all.

    Raises:
      ValueError: ``every`` or ``keep`` is not a positive integer.
    """

    def __init__(self, directory: str | Path, *, every: int = 100, keep: int | None = 3):
        if not is_count(every):
            raise ValueError(f"every={every!r}: checkpoints are saved every K steps, so use an integer K >= 1.")
        if keep is not None and not is_count(keep):
            raise ValueError(f"keep={keep!r}: use an integer >= 1 (how many checkpoints to keep), or None for all.")
        self.directory = Path(directory).expanduser().absolute()  # orbax wants an absolute path
        self.every, self.keep = every, keep
        self._manager: ocp.CheckpointManager | None = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The underlying ``orbax.checkpoint.CheckpointManager`` (created on first use)."""
        if self._manager is None:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(
                save_interval_steps=self.every,
                max_to_keep=self.keep,
                enable_async_checkpointing=False,  # a saved step is on disk before the next step starts
                create=True,
            )
            handlers = {_STATE: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()}
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    def steps(self) -> list[int]:
        """The steps that have a complete checkpoint, oldest first."""
        if self._manager is None and not self.directory.is_dir():
            return []  # reading must not create the directory
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpointed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, state: TrainState, strategy: Strategy, *, batches: int | None = None, force: bool = False) -> bool:
        """Save ``state`` (placed by ``strategy``) at its step, if that step is due or ``force``.

        Every process of a cluster must call this together.

        Args:
          state: the placed training state.
          strategy: the strategy that placed it.
          batches: how many batches the run has consumed (default: the step), for resuming.
          force: save even when the step is not a multiple of ``every``.

        Returns:
          True if a checkpoint was written.

        Raises:
          ValueError: the strategy's run cannot be resumed from its state alone
            (an async ParameterServer), or the state has no single owner across processes.
        """
        import orbax.checkpoint as ocp

        if refusal := strategy.checkpoint_refusal():
            raise ValueError(refusal)
        step = host_step(strategy, state)
        if not (force or self.should_save(step)) or step in self.manager.all_steps():
            return False
        tree = _state_tree(state)
        if jax.process_count() > 1 and any(x.is_fully_addressable for x in jax.tree.leaves(tree)):
            raise ValueError(
                f"{strategy!r} keeps this process's state on its own devices only, but {jax.process_count()} "
                "processes would write one checkpoint. Checkpoint a strategy whose state spans every process "
                "(MultiWorkerMirrored), or save from a single-process run."
            )
        if not _is_logical(strategy, tree):  # pmap's stacked copies: save one host copy
            tree = jax.device_get(strategy.unreplicate(tree))
        meta = {"step": step, "batches": step if batches is None else int(batches), "strategy": repr(strategy)}
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(tree), _META: ocp.args.JsonSave(meta)})
        saved = self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()
        return bool(saved)

    def restore(
        self,
        strategy: Strategy,
        params: PyTree,
        tx: optax.GradientTransformation,
        step: int | None = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> _Restored:
        """Restore a checkpoint (the newest by default) onto ``strategy``'s placement.

        Conceptually, ``strategy.init(params, tx)`` with the saved values: ``params``
        and ``tx`` give the tree structure, shapes and dtypes, the strategy gives the
        shardings. The device count may differ from the one that saved it. A state
        saved with a PRNG key or model state needs ``rng`` (any seed) and
        ``model_state`` (for example the initial one) as templates; the saved values
        replace them.

        Raises:
          FileNotFoundError: there is no checkpoint (at ``step``) in the directory.
          ValueError: the checkpoint does not fit this model, optimizer or strategy.
        """
        import orbax.checkpoint as ocp

        available = self.steps()
        if step is None:
            step = available[-1] if available else None
        if step is None or step not in available:
            raise FileNotFoundError(
                f"No checkpoint {'' if step is None else f'for step {step} '}in {self.directory} "
                f"(found steps: {available or 'none'}). Check the directory, or train without resuming to create one."
            )
        template = strategy.init(params, tx, model_state=model_state, rng=rng)
        if "loss_scale" in self._saved_tree(step):  # a dynamic loss scale rides where the step counter does
            template = template.replace(loss_scale=_like_step(template, LossScaleState(np.float32(1), np.int32(0))))
        placed = _state_tree(template)
        logical = _is_logical(strategy, placed)
        if logical:  # read each shard straight into its place
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), placed)
        else:  # one host copy, placed below by strategy.init
            target = jax.tree.map(np.asarray, strategy.unreplicate(placed))
        del template, placed
        self._check_fits(step, target, strategy)
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target), _META: ocp.args.JsonRestore()})
        try:
            out = self.manager.restore(step, args=args)
        except (ValueError, KeyError, TypeError) as err:
            raise self._does_not_fit(step, strategy, f"{type(err).__name__}: {err}") from err
        tree, meta = out[_STATE], out[_META]
        extras = {"rng": tree.get("rng"), "model_state": tree.get("model_state")}
        scale = None if "loss_scale" not in tree else LossScaleState(**tree["loss_scale"])
        if logical:
            state = TrainState(
                step=tree["step"], params=tree["params"], opt_state=tree["opt_state"], tx=tx, loss_scale=scale, **extras
            )
        else:
            state = strategy.init(tree["params"], tx, tree["opt_state"], **extras)
            state = state.replace(step=_like_step(state, np.int32(np.asarray(tree["step"]))))
            if scale is not None:
                state = state.replace(loss_scale=_like_step(state, scale))
        log.info("Restored step %d from %s onto %r.", step, self.directory, strategy)
        return _Restored(state, step, int(meta["batches"]))

    def _saved_tree(self, step: int) -> PyTree:
        """The metadata of the state saved at ``step``: its tree of leaves' shapes and dtypes."""
        metadata = self.manager.item_metadata(step)[_STATE]
        return getattr(metadata, "tree", metadata)  # a TreeMetadata, or the tree itself

    def _check_fits(self, step: int, target: PyTree, strategy: Strategy) -> None:
        """Compare the saved tree's paths, shapes and dtypes with ``target``'s before reading anything."""
        saved = _leaf_table(self._saved_tree(step))
        wanted = _leaf_table(target)
        differ = [path for path in sorted(saved.keys() | wanted.keys()) if saved.get(path) != wanted.get(path)]
        if differ:
            first = f"{differ[0]}: saved {saved.get(differ[0], 'nothing')}, expected {wanted.get(differ[0], 'nothing')}"
            raise self._does_not_fit(step, strategy, f"first difference: {first}")

    def _does_not_fit(self, step: int, strategy: Strategy, why: str) -> ValueError:
        return ValueError(
            f"The checkpoint at step {step} in {self.directory} does not fit {strategy!r} with these parameters "
            f"and optimizer ({why}). Restore with the model and optimizer that saved it; "
            "a ParameterServer checkpoint restores only onto a ParameterServer with the same number of shards."
        )

    def close(self) -> None:
        """Finish pending writes and release the directory."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, every={self.every}, keep={self.keep})"


def restore_or_check(
    ckpt: Checkpoints,
    resume: bool,
    strategy: Strategy,
    params: PyTree,
    tx: optax.GradientTransformation,
    model_state: PyTree = None,
    rng: int | jax.Array | None = None,
) -> tuple[TrainState, int, int] | None:
    """With ``resume``: (restored state, batches it had consumed, its step). Without: None, if the directory is new.

    Raises:
      ValueError: the strategy cannot be checkpointed, or, without ``resume``, the
        directory already holds another run's checkpoints.
      FileNotFoundError: ``resume`` but the directory holds no checkpoint.
    """
    if refusal := strategy.checkpoint_refusal():
        raise ValueError(refusal)
    if not resume:
        if ckpt.steps():
            raise ValueError(
                f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}) of an earlier run. "
                "Pass resume=True to continue that run, or give an empty checkpoint_dir for a new one."
            )
        return None
    if ckpt.latest_step() is None:
        raise FileNotFoundError(
            f"resume=True, but {ckpt.directory} holds no checkpoint yet. Start the run without resume "
            f"(it saves every {ckpt.every} steps), or point checkpoint_dir at the interrupted run's."
        )
    restored = ckpt.restore(strategy, params, tx, model_state=model_state, rng=rng)
    return restored.state, restored.batches, restored.step


def save(directory: str | Path, state: TrainState, strategy: Strategy) -> None:
    """Save ``state`` at its step in ``directory`` (one checkpoint, kept with any others there)."""
    with Checkpoints(directory, keep=None) as ckpt:
        ckpt.save(state, strategy, force=True)


def restore(
    directory: str | Path,
    strategy: Strategy,
    params: PyTree,
    tx: optax.GradientTransformation,
    step: int | None = None,
    *,
    model_state: PyTree = None,
    rng: int | jax.Array | None = None,
) -> TrainState:
    """The newest checkpoint in ``directory`` (or ``step``), placed as ``strategy.init(params, tx)`` would place it.

    ``model_state`` and ``rng`` are templates for a state saved with them (see :meth:`Checkpoints.restore`).

    Raises:
      FileNotFoundError, ValueError: as :meth:`Checkpoints.restore` (no checkpoint there; one that does not fit).
    """
    with Checkpoints(directory, keep=None) as ckpt:
        return ckpt.restore(strategy, params, tx, step, model_state=model_state, rng=rng).state


def latest_step(directory: str | Path) -> int | None:
    """The newest checkpointed step in ``directory``, or None (also when the directory does not exist)."""
    with Checkpoints(directory, keep=None) as ckpt:
        return ckpt.latest_step()
