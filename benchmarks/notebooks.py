"""How long each notebook of the course takes to run top to bottom, on this machine.

Each notebook runs once, in order, in a fresh kernel in a scratch directory, exactly
as ``make course`` and the test suite run them (``pk.course.build.execute``: the kernel
starts without this process's ``XLA_FLAGS`` and ``PJRT_NPROC``). The wall time of each
run, kernel start included, is recorded with the machine's core count: the figure the
course page (docs/course.md) quotes.

Run it when nothing else uses the cores (other work slows the notebooks with it):

    .venv/bin/python benchmarks/notebooks.py        # about five minutes on 2 cores

It prints one line per notebook and writes ``benchmarks/results/notebooks.json``. With
``--only``, the notebooks named are timed again and the other notebooks' times are kept
from the file already there (the record's ``date`` is then the latest run's). With
``--keep-going``, a notebook that fails is recorded with its error's last line under
``failed`` and the next one runs (the script then exits 1); without it the first failure
stops the run. The record names JAX's first device (its kind and how many), read in a
child process so that this one leaves an accelerator's memory to the kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", help="these notebooks (file names), not all")
    parser.add_argument("--timeout", type=int, default=600, help="seconds for each cell")
    parser.add_argument("--out", default="benchmarks/results/notebooks.json")
    parser.add_argument("--keep-going", action="store_true", help="record a failing notebook and run the next")
    args = parser.parse_args(argv)

    from parallelkit.course.build import NOTEBOOKS, execute

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.only:
        unknown = set(args.only) - {p.name for p in paths}
        if unknown:
            raise SystemExit(f"--only {sorted(unknown)}: not in {NOTEBOOKS}; choose from {[p.name for p in paths]}.")
        paths = [p for p in paths if p.name in args.only]
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    for path in paths:
        with tempfile.TemporaryDirectory() as workdir:
            start = time.perf_counter()
            try:
                execute(path, Path(workdir), timeout=args.timeout)
            except Exception as error:  # a cell raised or timed out: nbclient's errors share no narrower base
                if not args.keep_going:
                    raise
                failed[path.name] = _last_line(error)
                print(f"{path.name:<40}  failed: {failed[path.name]}", flush=True)
                continue
            seconds[path.name] = time.perf_counter() - start
        print(f"{path.name:<40}{seconds[path.name]:>8.1f} s", flush=True)
    if not seconds:
        raise SystemExit(f"every notebook failed: {failed}")
    if args.only and Path(args.out).exists():
        seconds = json.loads(Path(args.out).read_text())["seconds"] | seconds  # the others, as recorded
    slowest = max(seconds, key=seconds.get)
    print(f"slowest: {slowest}, {seconds[slowest]:.1f} s; all: {sum(seconds.values()):.0f} s")
    record = {
        "what": "each notebook run top to bottom in a fresh kernel (pk.course.build.execute), kernel start included",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(), "processor": platform.processor(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "devices": _devices(), "args": vars(args), "seconds": seconds, "failed": failed, "slowest": slowest,
        "max_s": seconds[slowest], "total_s": sum(seconds.values()),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 1 if failed else 0


def _last_line(error: Exception) -> str:
    """The last non-empty line of an error's message: for a failed cell, the exception it raised."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def _devices() -> str:
    """JAX's default devices as a kernel sees them ("2 x cpu", "1 x NVIDIA H100 80GB HBM3"), read in a child process."""
    probe = "import jax; d = jax.devices(); print(f'{len(d)} x {d[0].device_kind}')"
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "PJRT_NPROC")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    return done.stdout.strip() or f"unknown ({done.stderr.strip().splitlines()[-1:]})"


if __name__ == "__main__":
    sys.exit(main())
