"""The catalog of strategies: what the tools know of each (:class:`Entry`); :func:`register` adds one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from ..core.protocol import StrategyProtocol
from ..measure import costmodel
from .context_parallel import ContextParallel
from .expert_parallel import ExpertParallel
from .fully_sharded import FullySharded
from .hybrid import Hybrid
from .mirrored import Mirrored, MirroredJit
from .multiworker import MultiWorkerMirrored
from .offdevice import CentralStorage, ParameterServer
from .pipeline import Pipeline
from .pmap import MirroredPmap
from .single import SingleDevice
from .tensor import TensorParallel


@dataclass(frozen=True)
class Entry:
    """One strategy as the tools see it.

    ``make(n)`` builds it for ``n`` devices; an entry with ``layers=True`` (a pipeline) is
    built as ``make(n, apply)`` from the model's layers (:func:`parallelkit.models.as_layers`'s
    ``apply``) and trains on :func:`parallelkit.models.cross_entropy` of them.
    """

    name: str  # its label in the tour's and the bench's tables
    make: Callable[..., StrategyProtocol]
    tensorflow: str | None  # the Rosetta's TensorFlow counterpart (None: none built in)
    pytorch: str | None  # the Rosetta's PyTorch counterpart
    pattern: str  # the class's (SingleDevice.pattern, TensorParallel.pattern_for(...)): a key of pk.costmodel.PATTERNS
    meant_to_differ: bool = False  # differs from SingleDevice by design (asynchronous updates)
    min_devices: int = 1  # the fewest devices it is built for (a d x k mesh needs 4 to show both axes)
    layers: bool = False  # built from the model's layers (a pipeline): make(n, apply)
    tour: bool = True  # a row of the tour
    bench: bool = True  # a row of the bench's in-process children


_ENTRIES: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
    """Add ``entry`` to the catalog, after those already there; its name must be new.

    Raises:
      ValueError: an entry of that name exists (:func:`unregister` it first).
    """
    if entry.name in _ENTRIES:
        raise ValueError(f"The catalog already holds a strategy named {entry.name!r}; unregister it first.")
    costmodel.name_strategy(entry.name, entry.pattern)  # checks the pattern exists
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> Entry:
    """Remove the entry named ``name`` and return it."""
    get(name)
    costmodel.name_strategy(name, None)
    return _ENTRIES.pop(name)


def get(name: str) -> Entry:
    """The entry named ``name``; a clear error names the catalog's entries when there is none.

    Example:
      >>> entry = get("Mirrored(jit)")
      >>> entry.pattern, entry.tensorflow
      ('mirrored', 'tf.distribute.MirroredStrategy')
      >>> [e.name for e in entries(tour=True)][:3]
      ['SingleDevice', 'Mirrored(jit)', 'Mirrored(pmap)']
    """
    if name not in _ENTRIES:
        raise KeyError(f"No strategy named {name!r} in the catalog; it holds {list(_ENTRIES)}.")
    return _ENTRIES[name]


def entries(*, tour: bool | None = None, bench: bool | None = None) -> list[Entry]:
    """The entries in catalog order, those in the tour or the bench when ``tour`` or ``bench`` is given."""
    return [e for e in _ENTRIES.values() if (tour is None or e.tour == tour) and (bench is None or e.bench == bench)]


def reference() -> Entry:
    """The entry every other is compared with: SingleDevice, the single-device program."""
    return get(_REFERENCE)


_REFERENCE = "SingleDevice"


def _built_in() -> None:
    """The kit's own strategies, in the order the tables show them."""
    mirrored_tf, mirrored_torch = "tf.distribute.MirroredStrategy", "DistributedDataParallel"
    ps_tf, ps_torch = "tf.distribute.ParameterServerStrategy", "torch.distributed.rpc"
    for entry in (
        Entry("SingleDevice", lambda n: SingleDevice(), "tf.device", "x.to", SingleDevice.pattern),
        Entry("Mirrored(jit)", lambda n: Mirrored(n, backend="jit"), mirrored_tf, mirrored_torch,
              MirroredJit.pattern),
        Entry("Mirrored(pmap)", lambda n: Mirrored(n, backend="pmap"), mirrored_tf, mirrored_torch,
              MirroredPmap.pattern),
        Entry("Mirrored(ring)", lambda n: Mirrored(n, allreduce="ring"), "tf.distribute.NcclAllReduce",
              "dist.all_reduce", MirroredJit.pattern, tour=False),
        Entry("CentralStorage", lambda n: CentralStorage(n),
              "tf.distribute.experimental.CentralStorageStrategy", None, CentralStorage.pattern),
        Entry("PS(2 shards)", lambda n: ParameterServer(2, devices=n), ps_tf, ps_torch, ParameterServer.pattern),
        Entry("TensorParallel", lambda n: TensorParallel(n, devices=jax.devices()[:n]), None, "ColwiseParallel",
              TensorParallel.pattern_for()),
        Entry("FullySharded(3)", lambda n: FullySharded(3, n), None, "FullyShardedDataParallel",
              FullySharded.pattern),
        Entry("Hybrid(data x 2)", lambda n: Hybrid(n // 2, 2, devices=jax.devices()[: n // 2 * 2]), None,
              "HYBRID_SHARD", Hybrid.pattern, min_devices=4, tour=False),
        Entry("Pipeline(2 stages)", lambda n, apply: Pipeline(apply, 2, microbatches=4, data=n // 2,
              devices=jax.devices()[: n // 2 * 2]), None, "torch.distributed.pipelining", Pipeline.pattern,
              min_devices=2, layers=True, tour=False),
        Entry("MultiWorkerMirrored", lambda n: MultiWorkerMirrored(jax.devices()[:n]),
              "MultiWorkerMirroredStrategy", mirrored_torch, MultiWorkerMirrored.pattern, bench=False),
        Entry("PS(2, async)", lambda n: ParameterServer(2, mode="async", devices=n), ps_tf, ps_torch,
              ParameterServer.pattern, meant_to_differ=True, bench=False),
        # Not in the tour or the bench: they train a classifier without experts, on which ExpertParallel is data
        # parallelism over all its devices (no parameter declares `expert`; its init warns so); its all-to-alls
        # need MoE layers.
        Entry("ExpertParallel", lambda n: ExpertParallel(expert=n, devices=jax.devices()[:n]), None,
              "--expert-model-parallel-size", ExpertParallel.pattern, tour=False, bench=False),
        # Splitting the sequence needs a model that names its sequence axes (pk.models.GPT); the tour and the
        # bench train the digits MLP, whose inputs have no token axis: in neither table.
        Entry("TensorParallel(SP)", lambda n: TensorParallel(n, sequence_parallel=True, devices=jax.devices()[:n]),
              None, "SequenceParallel", TensorParallel.pattern_for(sequence_parallel=True), tour=False, bench=False),
        *(Entry(f"ContextParallel({method})", _context(method), None, torch, ContextParallel.pattern_for(method),
                min_devices=2, tour=False, bench=False) for method, torch in _CONTEXT_ROSETTA),
    ):  # fmt: skip
        register(entry)


_CONTEXT_ROSETTA = (  # each method and its PyTorch counterpart in docs/rosetta.md
    ("allgather", "--context-parallel-size"),
    ("ring", "torch.distributed.tensor.experimental.context_parallel"),
    ("ring_zigzag", "torch.distributed.tensor.experimental.context_parallel"),
    ("ulysses", "DeepSpeed-Ulysses"),
)


def _context(method: str) -> Callable[[int], ContextParallel]:
    """Context parallelism over the sequence of every sequence on ``n`` devices, by ``method``."""
    return lambda n: ContextParallel(seq=n, method=method, devices=jax.devices()[:n])


_built_in()
