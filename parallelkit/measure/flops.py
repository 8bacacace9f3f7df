"""How much arithmetic a training step does: the compiler's count (:func:`flops`) beside the textbook's
(:func:`dense_training_flops`, :func:`mlp_matmul_flops`).

References:
  Kaplan et al., "Scaling Laws for Neural Language Models", 2020: ``6 x parameters`` a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..core.step import check_step_call


@dataclass(frozen=True)
class StepCost:
    """XLA's estimate of one call of a compiled step, for ONE device's program.

    With SPMD (``jit`` with shardings, ``pmap``, ``shard_map``) every device runs the same
    program on its share, and XLA's cost analysis describes that per-device program:
    a step split over 2 devices reports about half the FLOPs of the one-device step.
    """

    flops: float  # floating-point operations of one device's program
    bytes_accessed: float  # bytes read and written by its operations (after fusion)
    transcendentals: float | None  # exp, log, tanh, ...: counted apart from flops; None if not reported
    devices: int  # devices the program runs on (1 for a single-device step)

    @property
    def total_flops(self) -> float:
        """``flops x devices``: the whole step's FLOPs, replicated work counted once per device."""
        return self.flops * self.devices

    @property
    def intensity(self) -> float:
        """FLOPs per byte accessed: the step's arithmetic intensity (see ``roofline``)."""
        return self.flops / self.bytes_accessed


def cost_of(compiled: Any) -> StepCost:
    """The :class:`StepCost` of a compiled program (``jax.jit(f).lower(...).compile()``).

    In JAX 0.10 ``compiled.cost_analysis()`` returns one dict (older versions returned a
    list holding one dict per program; both are accepted). Its keys include ``"flops"``,
    ``"bytes accessed"`` and ``"transcendentals"``.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((8, 16), jnp.float32)
    >>> cost = cost_of(jax.jit(lambda a, b: a @ b).lower(x, x.T).compile())
    >>> cost.flops == 2 * 8 * 16 * 8, cost.devices
    (True, 1)
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):
        if len(analysis) != 1:
            raise ValueError(f"Expected the cost analysis of one program, got {len(analysis)}: pass one program.")
        analysis = analysis[0]
    if not analysis or "flops" not in analysis:
        raise ValueError(
            "This backend's compiler reports no FLOP count (cost_analysis() has no 'flops'): "
            "count by hand with mlp_matmul_flops or dense_training_flops instead."
        )
    shardings = jax.tree.leaves(compiled.input_shardings)
    devices = max((len(s.device_set) for s in shardings), default=1)
    transcendentals = analysis.get("transcendentals")
    return StepCost(
        flops=float(analysis["flops"]),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
        transcendentals=None if transcendentals is None else float(transcendentals),
        devices=devices,
    )


def flops(step: Any, state: Any, batch: Any) -> StepCost:
    """What XLA counts for one call of ``step(state, batch)``, per device.

    Compiles the step (``step.lower(state, batch).compile()``) without running it. For a
    strategy whose step is several programs (central storage and parameter servers
    update the state on the host side), ``step.lower`` gives the workers' gradient
    program, so the update's FLOPs are not in the count.

    Args:
        step: a strategy's step (``strategy.step(loss_fn)``) or any jitted function.
        state: the state it takes (``strategy.init(params, optimizer)``).
        batch: one global batch.

    Returns:
        The :class:`StepCost` of one device's program.
    """
    check_step_call("pk.inspect.flops", step, state)
    return cost_of(step.lower(state, batch).compile())


def parameter_count(params: Any) -> int:
    """The number of scalars in a pytree of arrays (or an ``int``, returned as is).

    >>> parameter_count({"w": np.zeros((3, 4)), "b": np.zeros(4)})
    16
    """
    if isinstance(params, int | np.integer):
        return int(params)
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(params)))


def dense_training_flops(params: Any, tokens: int, *, layers: int = 0, seq_len: int = 0, d_model: int = 0) -> float:
    """The textbook FLOPs of training a dense model on ``tokens`` tokens (or examples).

    ``6 x parameters x tokens``: every weight takes part in one multiply-add (2 FLOPs)
    per token forward and two backward (the weight and the input gradients). For a
    transformer, attention adds ``12 x layers x seq_len x d_model`` per token (the
    query-key and attention-value products, forward and backward, which use no
    weights). This is the count of Chowdhery et al., "PaLM: Scaling Language Modeling
    with Pathways" (2022), Appendix B: ``6N + 12 L H Q T`` per token, with ``H x Q``
    (heads x head size) = ``d_model``; the JAX scaling book's "All the Transformer Math
    You Need to Know" (https://jax-ml.github.io/scaling-book/transformers/) derives the
    same terms. Causal attention does only about half the attention work; the formula
    counts it whole, as PaLM's does. It is the "model FLOPs" of PaLM's MFU
    (``roofline.mfu``); other counts give other utilisations (``roofline.flops_utilisation``).

    Args:
        params: the parameter count, or the parameters themselves (a pytree).
        tokens: tokens (for a classifier: examples) in the step.
        layers, seq_len, d_model: a transformer's shape, for the attention term; leave
            them 0 for a network without attention.

    >>> dense_training_flops(1_000, 64)
    384000.0
    >>> dense_training_flops(1_000, 64, layers=2, seq_len=16, d_model=8)  # + 12*2*16*8*64
    580608.0
    """
    if tokens < 0 or min(layers, seq_len, d_model) < 0:
        raise ValueError(f"tokens={tokens}, layers={layers}, seq_len={seq_len}, d_model={d_model}: use counts >= 0.")
    per_token = 6 * parameter_count(params) + 12 * layers * seq_len * d_model
    return float(per_token * tokens)


def mlp_matmul_flops(batch: int, widths: Sequence[int], *, backward: bool = True) -> int:
    """The exact FLOPs of an MLP's matrix products for one batch, forward and backward.

    Layer ``i`` multiplies a ``(batch, widths[i])`` input by a ``(widths[i], widths[i+1])``
    weight: ``2 x batch x widths[i] x widths[i+1]`` FLOPs forward. Backward, its weight
    gradient (``input.T @ grad``) costs the same, and so does its input gradient
    (``grad @ weight.T``), except for the first layer, whose input is data and needs no
    gradient. Biases, activations, the loss and the optimizer are not matmuls and are
    not counted.

    Args:
        batch: examples in the batch.
        widths: input size, hidden sizes, output size: ``(64, 64, 10)`` is two layers.
        backward: count the backward products too (training); False for the forward only.

    >>> mlp_matmul_flops(64, (20, 32, 5), backward=False)  # 2*64*(20*32 + 32*5)
    102400
    >>> mlp_matmul_flops(64, (20, 32, 5))  # forward x 2 + the second layer's input gradient
    225280
    """
    if batch < 1 or len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"batch={batch}, widths={tuple(widths)}: need batch >= 1 and at least two widths >= 1.")
    layers = [2 * batch * n_in * n_out for n_in, n_out in zip(widths[:-1], widths[1:], strict=True)]
    forward = sum(layers)
    if not backward:
        return forward
    return forward + sum(layers) + sum(layers[1:])
