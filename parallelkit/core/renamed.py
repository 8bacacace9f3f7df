"""Old names kept for one release: each found at its new home, with a ``DeprecationWarning``.

:func:`renamed` gives a module the ``__getattr__`` that finds its old names; :func:`moved_module`
warns once, as a module that moved is imported under its old name.

>>> import warnings
>>> old = renamed("parallelkit.example", {"Old": "parallelkit.core.mesh:make_mesh"})
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     old("Old").__name__, caught[0].category.__name__
('make_mesh', 'DeprecationWarning')
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

REMOVED_IN = "0.2"  # the release after this one: old names go then


def renamed(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved: each old name's new home, with a ``DeprecationWarning``.

    Args:
      module: the dotted name of the module the old names were read from (for the messages).
      moves: each old name to its new home, ``"package.module:name"`` for a name in a module or
        ``"package.module"`` for a module itself.

    Returns:
      A function to assign to the module's ``__getattr__``: it loads the new home only when an
      old name is asked for, and raises ``AttributeError`` for any other name.
    """

    def __getattr__(name: str) -> Any:
        if name not in moves:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, attribute = moves[name].partition(":")
        new = f"{home}.{attribute}" if attribute else home
        warnings.warn(
            f"{module}.{name} is now {new}, and the old name goes in parallelkit {REMOVED_IN}. Import {new} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        found = import_module(home)
        return getattr(found, attribute) if attribute else found

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Warn that module ``old`` is now ``new``: call it from ``old``'s body, which Python runs once.

    The warning points at the line that imported ``old`` (``warnings`` passes over the import
    machinery's frames), so it shows where that line's warnings show.
    """
    warnings.warn(
        f"{old} is now {new}, and the old name goes in parallelkit {REMOVED_IN}. Import {new} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
