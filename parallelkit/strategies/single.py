"""The single-device reference: the yardstick every other strategy must match."""

from __future__ import annotations

from functools import cached_property

import jax
from jax.sharding import SingleDeviceSharding

from .jit import JitStrategy


class SingleDevice(JitStrategy):
    """Train on one device: ``jax.device_put`` the state there, ``jax.jit`` the step.

    The counterpart of a plain ``tf.device("/GPU:0")`` block or a PyTorch model on
    ``cuda:0``. Every other strategy is tested to reproduce its parameters.

    Args:
      device: the device to use; JAX's first device by default.
    """

    def __init__(self, device: jax.Device | None = None):
        super().__init__([device] if device is not None else 1)

    @property
    def device(self) -> jax.Device:
        return self.devices[0]

    @cached_property
    def state_sharding(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.device)

    @cached_property
    def batch_sharding(self) -> SingleDeviceSharding:
        return self.state_sharding

    def __repr__(self) -> str:
        return f"SingleDevice({self.device})"
