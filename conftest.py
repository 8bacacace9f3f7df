"""Simulated devices for the whole test session, in one place.

The device count is fixed when JAX starts, so it is set here, before any test or
doctest module touches JAX. Tests that need another count run in a subprocess
(see ``tests/conftest.py``).
"""

import parallelkit as pk

TEST_DEVICES = 8
pk.simulate_devices(TEST_DEVICES)

# The views' old name warns as it loads (tests/test_moved_names.py expects it); it holds no doctest.
collect_ignore = ["parallelkit/widgets/__init__.py"]
