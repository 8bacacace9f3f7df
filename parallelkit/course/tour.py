"""The tour: one model, the same data and initial parameters, every strategy of one process, in one table."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import asdict, dataclass

import jax
import optax

from .. import data, models
from ..core.devices import device_summary
from ..core.protocol import StrategyProtocol
from ..run.compare import ATOL as ATOL
from ..run.compare import RTOL as RTOL
from ..run.compare import Run, compare, run_side_by_side
from ..run.compare import assert_close as assert_close
from ..run.compare import max_abs_diff as max_abs_diff
from ..run.training import FitResult
from ..strategies import catalog


class _Tour(Mapping):
    """The catalog's strategies of the tour, by name, each a constructor taking the device count (read live);
    with ``only_meant_to_differ``, those that differ from SingleDevice by design."""

    def __init__(self, only_meant_to_differ: bool = False):
        self.only_meant_to_differ = only_meant_to_differ

    def _entries(self) -> list[catalog.Entry]:
        return [e for e in catalog.entries(tour=True) if e.meant_to_differ or not self.only_meant_to_differ]

    def __getitem__(self, name: str) -> Callable[[int], StrategyProtocol]:
        entry = catalog.get(name)
        if entry not in self._entries():
            which = " as meant to differ" if self.only_meant_to_differ else ""
            raise KeyError(f"{name!r} is in the catalog but not in the tour{which}.")
        return entry.make

    def __iter__(self) -> Iterator[str]:
        return iter([e.name for e in self._entries()])

    def __len__(self) -> int:
        return len(self._entries())


# Every strategy of one process that the catalog puts in the tour, built for n devices.
# MultiWorkerMirrored runs here over this process's devices (across processes: `python -m
# parallelkit launch`). Left out: Hybrid, which needs d x k devices, and Pipeline, which
# needs the model cut into stages. MEANT_TO_DIFFER: each push applied alone, not the single-device step.
STRATEGIES: Mapping[str, Callable[[int], StrategyProtocol]] = _Tour()
MEANT_TO_DIFFER: Set[str] = _Tour(only_meant_to_differ=True).keys()


@dataclass(frozen=True)
class _TourRow:
    strategy: str
    devices: int
    compile_s: float
    median_step_ms: float
    samples_per_s: float
    final_loss: float
    max_param_diff: float  # max |param - single-device param| after the run
    meant_to_equal: bool = True  # False: differs from SingleDevice by design (async)

    @classmethod
    def of(cls, run: Run) -> _TourRow:
        """The row of one run of :func:`~parallelkit.run.compare.run_side_by_side`."""
        return cls(
            run.name,
            run.devices,
            run.times.compile_seconds,
            run.times.median * 1e3,
            run.times.samples_per_second,
            float(run.result.history.losses[-1]),
            run.max_param_diff,
            run.meant_to_equal,
        )


def run_tour(
    model: str = "mlp",
    steps: int = 50,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    devices: int | None = None,
    strategies: Sequence[str] | None = None,
) -> list[_TourRow]:
    """Train ``model`` on the digits data with every strategy of the tour; the first row is the reference.

    ``strategies``: names of catalog entries to run instead, in that order (the first is the reference).
    """
    n = devices or jax.device_count()
    dataset = data.digits()
    apply, params = models.build(model, dataset.input_shape, dataset.num_classes)
    chosen = catalog.entries(tour=True) if strategies is None else [catalog.get(name) for name in strategies]
    runs = run_side_by_side(
        {entry.name: entry.make(n) for entry in chosen},
        models.classifier_loss(apply),
        params,
        optax.adam(learning_rate),
        lambda: data.batches(dataset, batch_size, steps=steps),
        meant_to_differ={entry.name for entry in chosen if entry.meant_to_differ},
    )
    return [_TourRow.of(run) for run in runs.values()]


def results_table(results: Mapping[str, FitResult], reference: str = "SingleDevice") -> str:
    """A table of ``pk.fit`` results by name, each run's parameters compared with ``results[reference]``'s."""
    if reference not in results:
        raise ValueError(f"No run named {reference!r} to compare with: the runs are {list(results)}.")
    expected = results[reference].params
    runs = [Run(name, r, r.history.times, *compare(r.params, expected)) for name, r in results.items()]
    return format_table([_TourRow.of(run) for run in runs])


def format_table(rows: list[_TourRow]) -> str:
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


def main(model: str, steps: int, batch_size: int, json_path: str | None = None) -> list[_TourRow]:
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
