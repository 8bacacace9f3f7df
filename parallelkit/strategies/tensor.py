"""Tensor parallelism, Megatron style (:class:`TensorParallel`): the weights themselves split over devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from ..core import partition
from ..core.axes import AxisRules
from ..core.devices import first_devices
from ..core.reports import ExpectedCollective, Sizes
from ..core.types import MODEL, PyTree, is_count
from ..models import declared_axes
from .parallel import SEQUENCE_PARALLEL as SEQUENCE_PARALLEL
from .parallel import TENSOR_AXES, Parallel, undeclared_axes_error
from .spmd import EXPLICIT


class TensorParallel(Parallel):
    """Split every large weight over ``model`` devices; the batch is not split.

    Conceptually, for one MLP block on ``k`` devices::

        h_i = act(x @ W1[:, cols_i] + b1[cols_i])   # device i: its columns of W1
        y = sum(h_i @ W2[rows_i, :] for i in range(k)) + b2   # the all-reduce
        # == act(x @ W1 + b1) @ W2 + b2, the single-device block

    and the gradients follow the same split, so the update equals SingleDevice's.

    Args:
      model: devices per model replica (the size of the ``model`` mesh axis).
      rules: ``(regex, PartitionSpec)`` pairs (first match wins; a parameter that none
        matches is an error), a tree of specs from :func:`parallelkit.core.partition.nnx_specs`,
        or an :class:`~parallelkit.core.axes.AxisRules` for the logical axes the model declares.
        Default: the logical axes the model's parameters declare (``nnx.with_partitioning``,
        found by :func:`parallelkit.models.declared_axes` for parameters from
        ``pk.models.from_nnx``, ``functional`` or ``build``) mapped by :data:`TENSOR_AXES`:
        Megatron's column and row splits for the kit's MLP, CNN and transformer, which declare
        them; a model that declares none needs rules.
      sequence_parallel: Megatron's sequence parallelism (:data:`SEQUENCE_PARALLEL`) for a model
        that names its residual stream's length ``norm_length`` and calls its split layers through
        :mod:`parallelkit.models.layers.sequence` (:class:`parallelkit.models.GPT` and the classifier
        ``Transformer`` do): layer norms and dropout on ``1/model`` of the tokens, and each block's
        all-reduce replaced by a reduce-scatter and an all-gather. Another model trains as under
        plain tensor parallelism.
      devices: which devices; the first ``model`` by default.
      explicit: a mesh of Explicit axes: each slice is its array's type, and the kit's layers say where a
        product of a split kernel lives (:func:`parallelkit.models.layers.basic.apply_layer`).

    Raises:
      DeviceCountError: ``devices`` that are not ``model`` in number.
      ValueError (at ``init``): unmatched parameters, a spec naming an axis the mesh
        lacks, or a dimension that does not divide by ``model``, each naming the leaf; no
        rules for a model that declares no logical axes.

    Warns:
      DeviceSubsetWarning: without ``devices``, when ``model`` is fewer than all the devices
        (the rest would stay idle; :class:`~parallelkit.Hybrid` can use them).
    """

    def __init__(
        self,
        model: int,
        rules: partition.Rules | PyTree | AxisRules | None = None,
        *,
        sequence_parallel: bool = False,
        devices=None,
        explicit: bool = False,
    ):
        if not is_count(model):
            raise ValueError(f"TensorParallel(model={model!r}) needs a whole number of devices >= 1.")
        if devices is None:  # the first `model` devices, with a warning if that leaves some idle
            devices = first_devices(model, 1, *hybrid_hint(model), who=f"TensorParallel(model={model})")
        super().__init__(1, tensor=model, sequence_parallel=sequence_parallel, devices=devices, explicit=explicit)
        self.model = model
        self.rules = rules

    shown_axes = (MODEL,)  # the mesh keeps its `model` axis at model=1

    def model_specs(self, params: PyTree) -> PyTree:
        return model_specs(params, self.rules, self.mesh)

    @staticmethod
    def pattern_for(sequence_parallel: bool = False) -> str:
        """The cost model's pattern of tensor parallelism, with or without Megatron's sequence parallelism."""
        return "sequence_parallel" if sequence_parallel else "tensor"

    @property
    def pattern(self) -> str:
        return self.pattern_for(self.sequence_parallel)

    def expected_collectives(self, sizes: Sizes) -> tuple[ExpectedCollective, ...] | None:
        """Megatron's all-reduces of activations (:func:`megatron_mlp_allreduces`) for the kit's
        MLP under the default rules; no formula for other models or rules."""
        widths = _mlp_widths(sizes.params_tree) if self.rules is None else None
        if widths is None:
            return None
        elements = megatron_mlp_allreduces(sizes.batch, widths)
        itemsize = jax.tree.leaves(sizes.params_tree)[0].dtype.itemsize
        what = f"activations, {len(elements)} partial sum(s)"
        return (ExpectedCollective("all-reduce", what, sum(elements) * itemsize, "B x block widths (Megatron)"),)

    def __repr__(self) -> str:
        sequence = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"TensorParallel(model={self.model}{sequence}{EXPLICIT if self.explicit else ''})"


def hybrid_hint(model: int) -> tuple[Callable[[int], str], str]:
    """``Hybrid(data, model)`` spelled for a number of replicas, and its sizes: :func:`first_devices`'s ``spell, sizes``
    for a strategy with ``model`` devices per model replica."""
    return (lambda d: f"Hybrid(data={d}, model={model})"), "a Hybrid(data, model) with data x model"


def _mlp_widths(params: PyTree) -> list[int] | None:
    """The layer widths of the kit's MLP, input first (``[64, 64, 10]``); None for another model."""
    if not (isinstance(params, dict) and set(params) == {"hidden", "head"}):
        return None
    kernels = [params["hidden"][i]["kernel"] for i in sorted(params["hidden"])] + [params["head"]["kernel"]]
    return [kernels[0].shape[0], *(k.shape[1] for k in kernels)]


def model_specs(params: PyTree, rules: partition.Rules | PyTree | AxisRules | None, mesh: Mesh) -> PyTree:
    """The specs ``rules`` give ``params`` (the declared logical axes under :data:`TENSOR_AXES` when None),
    checked against ``mesh``."""
    if rules is None or isinstance(rules, AxisRules):
        rules = partition.logical_specs(_declared(params), (rules if rules is not None else TENSOR_AXES).spec)
    specs = partition.param_specs(params, rules)
    partition.check_specs(params, specs, mesh)
    return specs


def _declared(params: PyTree) -> PyTree:
    """The logical axes ``params`` declare; an error saying to give rules when they declare none."""
    axes = declared_axes(params)
    if axes is None:
        raise undeclared_axes_error(params)
    return axes


def megatron_mlp_allreduces(batch: int, sizes: Sequence[int]) -> list[int]:
    """The all-reduces (in float elements each) one training step of a Megatron-split MLP needs, by the book.

    ``sizes`` are the layer widths, input first: ``[64, 64, 10]`` for the digits MLP.
    Layers pair into blocks (column split, then row split). Forward, each block ends
    with one all-reduce of its partial outputs: ``batch x`` its output width. Backward,
    each block but the first needs the gradient of its input summed over the devices
    (each holds a partial one): ``batch x`` its input width; the first block's input
    is the data, whose gradient nobody needs. A layer left over after the last pair
    is replicated and moves nothing.

    >>> megatron_mlp_allreduces(32, [64, 64, 32, 16, 10])  # two blocks
    [1024, 320, 1024]
    """
    layers = len(sizes) - 1
    blocks = range(0, layers - 1, 2)  # a block: layers i (columns) and i + 1 (rows)
    forward = [batch * sizes[i + 2] for i in blocks]
    backward = [batch * sizes[i] for i in blocks if i > 0]
    return forward + backward
