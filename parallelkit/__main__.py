"""Command line: ``python -m parallelkit tour [--devices N] [--model mlp|cnn] [--steps K]``,
``python -m parallelkit launch --processes 2 --devices-per-process 2 script.py [args]``,
``python -m parallelkit bench [--quick] [--devices 1 2 4 8] [--processes 2x2] [--out FILE]``,
``python -m parallelkit lab [jupyter lab options]``,
``python -m parallelkit course [--out DIR]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parallelkit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tour = commands.add_parser("tour", help="train one model with every strategy and compare them")
    tour.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    tour.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    tour.add_argument("--steps", type=int, default=50)
    tour.add_argument("--batch-size", type=int, default=64)
    tour.add_argument("--json", help="also save the table as JSON here")
    launch = commands.add_parser(
        "launch",
        help="run a script as a local multi-process JAX cluster (each process calls pk.distributed.initialize())",
    )
    launch.add_argument("--processes", type=int, default=2)
    launch.add_argument(
        "--devices-per-process", type=int, default=2, help="simulated CPU devices (or GPUs) per process"
    )
    launch.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    launch.add_argument("--init-timeout", type=int, default=20, help="seconds each process has to join")
    launch.add_argument("--heartbeat-timeout", type=int, default=10, help="seconds before a silent peer is dead")
    launch.add_argument("--host", default="127.0.0.1", help="coordinator address (loopback by default)")
    launch.add_argument(
        "--platform",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu: simulated CPU devices (default); gpu: each process gets its own GPUs (CUDA_VISIBLE_DEVICES)",
    )
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    commands.add_parser(
        "bench",
        add_help=False,
        help="time every strategy over 1, 2, 4 and 8 devices and 2 processes x 2 devices (--help for options)",
    )
    commands.add_parser(
        "lab",
        help="open the course in JupyterLab (as root too; without a display it prints the URL with its token); "
        "other options go to `jupyter lab`",
    )
    course = commands.add_parser(
        "course", help="run every notebook top to bottom and write the course as static HTML pages"
    )
    course.add_argument("--out", default="build/course", help="where the pages go (default: build/course)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    if args.command == "lab":
        command = lab_command(extra)
        if "--no-browser" in command:
            print("No display here: open the URL Jupyter prints below (it carries the token) in a browser.")
        sys.stdout.flush()
        os.execv(sys.executable, command)  # Jupyter takes over this process
    if args.command == "bench":
        from .course.bench import main as bench

        return bench(extra)
    if extra:
        _parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "launch":
        return _launch(args)
    if args.command == "course":
        from pathlib import Path

        from .course.build import build

        pages = build(Path(args.out))
        print(
            f"wrote {len(pages) - 1} pages (the notebooks, then the references), the API reference and an index: "
            f"open {pages[0]}"
        )
        return 0
    import parallelkit as pk

    pk.simulate_devices(args.devices)  # before anything starts JAX
    if args.command == "tour":
        from .course.tour import main as tour

        tour(args.model, args.steps, args.batch_size, args.json)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .run.distributed import LaunchError, launch

    try:
        launch(
            [sys.executable, args.script, *args.script_args],
            args.processes,
            args.devices_per_process,
            timeout=args.timeout,
            init_timeout=args.init_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            host=args.host,
            platform=args.platform,
        )
    except LaunchError as err:
        print(f"parallelkit launch: {err}", file=sys.stderr)
        return 1
    return 0


def lab_command(
    extra: Sequence[str] = (), *, env: Mapping[str, str] | None = None, euid: int | None = None
) -> list[str]:
    """The ``jupyter lab`` command line that ``make lab`` runs, fitted to this machine.

    As root (containers, cloud machines) Jupyter refuses to start without
    ``--allow-root``; without a display (SSH, a container, CI) there is no browser to
    open, so Jupyter only prints the URL with its token (``--no-browser``).

    >>> lab_command(env={"DISPLAY": ":0"}, euid=0)[-1]
    '--allow-root'
    """
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None and hasattr(os, "geteuid") else euid
    notebooks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
    command = [sys.executable, "-m", "jupyterlab", notebooks if os.path.isdir(notebooks) else "notebooks"]
    if euid == 0:
        command.append("--allow-root")
    if sys.platform.startswith("linux") and not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")):
        command.append("--no-browser")
    return [*command, *extra]


if __name__ == "__main__":
    sys.exit(main())
