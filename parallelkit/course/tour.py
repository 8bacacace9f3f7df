"""The tour: one model, the same data and initial parameters, every strategy of one process.

Prints a table of compile time, median step time, throughput, final loss and the
largest difference from the single-device parameters, the number every synchronous
strategy must keep near zero. The asynchronous parameter server is in the table
too, marked: it applies each worker's gradient on its own, so it is meant to differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import asdict, dataclass

import jax
import numpy as np
import optax

from .. import data, models
from ..core.devices import device_summary
from ..core.protocol import StrategyProtocol
from ..run.training import FitResult, fit
from ..strategies import catalog


class _TourStrategies(Mapping):
    """The catalog's strategies of the tour, by name, each a constructor taking the device count (read live)."""

    def __getitem__(self, name: str) -> Callable[[int], StrategyProtocol]:
        entry = catalog.get(name)
        if not entry.tour:
            raise KeyError(f"{name!r} is in the catalog but not in the tour.")
        return entry.make

    def __iter__(self) -> Iterator[str]:
        return iter([e.name for e in catalog.entries(tour=True)])

    def __len__(self) -> int:
        return len(catalog.entries(tour=True))


class _MeantToDiffer(Set):
    """The names of the tour's strategies that differ from SingleDevice by design (read live from the catalog)."""

    def __contains__(self, name: object) -> bool:
        return name in set(self)

    def __iter__(self) -> Iterator[str]:
        return iter([e.name for e in catalog.entries(tour=True) if e.meant_to_differ])

    def __len__(self) -> int:
        return len(list(iter(self)))


# Every strategy of one process that the catalog puts in the tour, built for n devices.
# MultiWorkerMirrored runs here over this process's devices (across processes: `python -m
# parallelkit launch`). Left out: Hybrid, which needs d x k devices, and Pipeline, which
# needs the model cut into stages.
STRATEGIES: Mapping[str, Callable[[int], StrategyProtocol]] = _TourStrategies()
MEANT_TO_DIFFER: Set[str] = _MeantToDiffer()  # each push applied alone: not the single-device step


@dataclass(frozen=True)
class TourRow:
    strategy: str
    devices: int
    compile_s: float
    median_step_ms: float
    samples_per_s: float
    final_loss: float
    max_param_diff: float  # max |param - single-device param| after the run
    meant_to_equal: bool = True  # False: differs from SingleDevice by design (async)

    @classmethod
    def of(cls, name: str, result: FitResult, reference_params, meant_to_equal: bool = True) -> TourRow:
        """The row of one ``pk.fit`` run, its parameters compared with ``reference_params``."""
        times = result.history.times
        return cls(
            name,
            len(result.strategy.devices),
            times.compile_seconds,
            times.median * 1e3,
            times.samples_per_second,
            float(result.history.losses[-1]),
            max_abs_diff(result.params, reference_params),
            meant_to_equal,
        )


def max_abs_diff(a, b) -> float:
    """Largest absolute difference between two parameter trees of the same structure."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


RTOL, ATOL = 1e-5, 1e-6  # the float32 tolerance of every equivalence in parallelkit


def assert_close(actual, expected, rtol: float = RTOL, atol: float = ATOL) -> float:
    """Assert two trees of the same structure agree leaf by leaf (NumPy's ``allclose`` rule); return max |diff|.

    >>> round(assert_close({"w": np.ones(3)}, {"w": np.ones(3) + 1e-7}), 9)
    1e-07
    >>> assert_close({"w": np.ones(3)}, {"w": np.ones(3) + 0.1})
    Traceback (most recent call last):
    ...
    AssertionError: ...
    Not equal to tolerance rtol=1e-05, atol=1e-06
    leaf ['w'] differs...
    """
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(actual)[0], strict=True)
    if jax.tree.structure(actual) != jax.tree.structure(expected):
        raise AssertionError(
            f"The trees differ in structure: {jax.tree.structure(actual)} vs {jax.tree.structure(expected)}"
        )
    for path, x, y in zip(paths, leaves, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=f"leaf {jax.tree_util.keystr(path)} differs"
        )
    return max_abs_diff(actual, expected)


def run_tour(
    model: str = "mlp",
    steps: int = 50,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    devices: int | None = None,
    strategies: Sequence[str] | None = None,
) -> list[TourRow]:
    """Train ``model`` on the digits data with every strategy of the tour; the first row is the reference.

    ``strategies``: names of catalog entries to run instead, in that order (the first is the reference).
    """
    n = devices or jax.device_count()
    dataset = data.digits()
    apply, params = models.build(model, dataset.input_shape, dataset.num_classes)
    loss_fn = models.classifier_loss(apply)
    rows, reference = [], None
    for entry in catalog.entries(tour=True) if strategies is None else [catalog.get(name) for name in strategies]:
        result = fit(
            entry.make(n), loss_fn, params, optax.adam(learning_rate), data.batches(dataset, batch_size, steps=steps)
        )
        reference = result.params if reference is None else reference
        rows.append(TourRow.of(entry.name, result, reference, not entry.meant_to_differ))
    return rows


def results_table(results: Mapping[str, FitResult], reference: str = "SingleDevice") -> str:
    """A table of ``pk.fit`` results by name, each run's parameters compared with ``results[reference]``'s."""
    if reference not in results:
        raise ValueError(f"No run named {reference!r} to compare with: the runs are {list(results)}.")
    reference_params = results[reference].params
    return format_table([TourRow.of(name, result, reference_params) for name, result in results.items()])


def format_table(rows: list[TourRow]) -> str:
    """The rows as a fixed-width text table."""
    header = (
        f"{'strategy':<20}{'devices':>8}{'compile s':>11}{'step ms':>10}{'samples/s':>12}{'loss':>9}{'max |dp|':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.strategy:<20}{r.devices:>8}{r.compile_s:>11.2f}{r.median_step_ms:>10.3f}{r.samples_per_s:>12.0f}{r.final_loss:>9.4f}{r.max_param_diff:>11.2e}"
            + ("" if r.meant_to_equal else "  (async: differs by design)")
        )
    return "\n".join(lines)


def main(model: str, steps: int, batch_size: int, json_path: str | None = None) -> list[TourRow]:
    summary = device_summary()
    print(f"parallelkit tour on {summary}; {model}, {steps} steps, global batch {batch_size}")
    rows = run_tour(model, steps, batch_size)
    print(format_table(rows))
    if summary.simulated:
        print(f"Times are for simulated CPU devices, {summary.simulation}.")
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump({"devices": str(summary), "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows
