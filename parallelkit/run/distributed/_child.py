"""One process of :func:`parallelkit.run.distributed.run_local`: join, run the function, save its result.

Usage (by the launcher): ``python -m parallelkit.run.distributed._child PAYLOAD.pkl OUT_DIR``
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(payload: str, out_dir: str) -> None:
    from .runtime import initialize

    spec = initialize()
    fn, args, kwargs = pickle.loads(Path(payload).read_bytes())
    result = fn(*args, **kwargs)
    tmp = Path(out_dir) / f"result-{spec.process_id}.pkl.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(tmp.with_suffix(""))  # complete files only


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
