"""The single-device reference: the yardstick every other strategy must match."""

from __future__ import annotations

import jax

from ..core.devices import resolve_devices
from ..core.mesh import make_mesh
from .base import Strategy
from .spmd import BATCH_ON_DATA, EXPLICIT, SPMD


class SingleDevice(SPMD):
    """Train on one device: the state placed there, the step under ``jax.jit``.

    The counterpart of a plain ``tf.device("/GPU:0")`` block or a PyTorch model on
    ``cuda:0``. Every other strategy is tested to reproduce its parameters. An
    :class:`~parallelkit.SPMD` preset over a mesh of one device (``data=1``).

    Args:
      device: the device to use; JAX's first device by default.
      explicit: a mesh of Explicit axes (the arrays' types carry their one-device shardings).
    """

    pattern = "single"

    def __init__(self, device: jax.Device | None = None, *, explicit: bool = False):
        chosen = resolve_devices([device] if device is not None else 1)
        super().__init__(make_mesh(chosen, data=1, explicit=explicit), rules=BATCH_ON_DATA)

    @property
    def device(self) -> jax.Device:
        return self.devices[0]

    expected_collectives = Strategy.expected_collectives  # none (SPMD's is no formula): one device talks to no other

    def __repr__(self) -> str:
        return f"SingleDevice({self.device}{EXPLICIT if self.explicit else ''})"
