"""Gradient buckets in the alpha-beta model: :func:`bucket_timeline` beside the backward pass."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from .links import Cluster, allreduce_seconds


@dataclass(frozen=True)
class BucketTimeline:
    """When each bucket's all-reduce starts and ends (seconds from the start of the backward pass)."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    backward_s: float

    @property
    def communication_s(self) -> float:
        """Every bucket's all-reduce, added up: the time on the wire, hidden or not."""
        return sum(end - start for start, end in zip(self.starts, self.ends, strict=True))

    @property
    def exposed_s(self) -> float:
        """What the step waits for after the backward pass: the all-reduces not hidden behind it."""
        return max(0.0, (self.ends[-1] if self.ends else 0.0) - self.backward_s)


def bucket_timeline(
    cluster: Cluster, bucket_bytes: Iterable[float], backward_s: float = 0.0, algorithm: str = "ring"
) -> BucketTimeline:
    """Play the buckets (bytes each, in the order they are reduced) over one communication stream.

    Args:
      cluster: the devices and their links; every bucket is all-reduced over all of them.
      bucket_bytes: each bucket's bytes, the first reduced first (the last layers').
      backward_s: the backward pass's seconds, during which the gradients appear at an even
        rate per byte; 0: no overlap (every all-reduce after the backward pass).
      algorithm: the all-reduce's (:func:`~.links.allreduce_seconds`).

    Raises:
      ValueError: a bucket that is not a finite number of bytes > 0, or a backward time that is not
        a finite number of seconds >= 0.

    Example:
      >>> from parallelkit.measure.costmodel import Cluster, Link
      >>> four = Cluster(1, 4, Link("test", GBps=10, latency_us=5, source="by hand"))
      >>> one = bucket_timeline(four, [4e6], backward_s=1e-3)           # one bucket, ready at the end
      >>> many = bucket_timeline(four, [1e6] * 4, backward_s=1e-3)      # four, the first ready at 1/4
      >>> round(one.exposed_s * 1e6), round(many.exposed_s * 1e6)       # us the step waits after the backward pass
      (630, 180)
      >>> round(bucket_timeline(four, [4e3] * 1000, backward_s=1e-3).exposed_s * 1e3, 1)  # latency-bound
      29.6
    """
    sizes = list(bucket_bytes)  # once: a generator would be spent by the check below
    if not all(_finite(b) and b > 0 for b in sizes):
        raise ValueError(
            f"bucket_timeline(bucket_bytes={sizes}): every bucket needs a finite number of bytes > 0. "
            "Give each bucket's bytes, in the order they are reduced."
        )
    if not (_finite(backward_s) and backward_s >= 0):
        raise ValueError(
            f"bucket_timeline(backward_s={backward_s!r}): the backward pass takes a finite number of seconds "
            ">= 0. Give its length, or 0 for no overlap."
        )
    total, produced, free = sum(sizes), 0.0, 0.0
    starts, ends = [], []
    for nbytes in sizes:
        produced += nbytes
        start = max(backward_s * produced / total, free)
        free = start + allreduce_seconds(cluster, nbytes, algorithm)
        starts.append(start)
        ends.append(free)
    return BucketTimeline(tuple(starts), tuple(ends), backward_s)


def _finite(x: object) -> bool:
    """Whether ``x`` is a finite real number (NumPy's too); a bool is not."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
