"""Simulated devices for the whole test session, in one place.

The device count is fixed when JAX starts, so it is set here, before any test or
doctest module touches JAX. Tests that need another count run in a subprocess
(see ``tests/conftest.py``).
"""

import parallelkit as pk

TEST_DEVICES = 8
pk.simulate_devices(TEST_DEVICES)
