"""The views' old home, kept for one release: ``parallelkit.widgets`` is now :mod:`parallelkit.viz`.

Importing it warns once (a ``DeprecationWarning``); every name, and the modules
``parallelkit.widgets.dashboard`` and ``parallelkit.widgets.live``, are :mod:`parallelkit.viz`'s.
"""

import sys
from typing import Any

from .. import viz
from ..core.renamed import moved_module
from ..viz import dashboard as dashboard
from ..viz import live as live

moved_module(__name__, viz.__name__)
sys.modules[f"{__name__}.dashboard"], sys.modules[f"{__name__}.live"] = dashboard, live


def __getattr__(name: str) -> Any:
    return getattr(viz, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *dir(viz)})
