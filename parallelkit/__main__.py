"""Command line: ``python -m parallelkit tour [--devices N] [--model mlp|cnn] [--steps K]``,
``python -m parallelkit launch --processes 2 --devices-per-process 2 script.py [args]``."""

from __future__ import annotations

import argparse
import sys


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
    launch.add_argument("--devices-per-process", type=int, default=2, help="simulated CPU devices per process")
    launch.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    launch.add_argument("--init-timeout", type=int, default=20, help="seconds each process has to join")
    launch.add_argument("--heartbeat-timeout", type=int, default=10, help="seconds before a silent peer is dead")
    launch.add_argument("--host", default="127.0.0.1", help="coordinator address (loopback by default)")
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return _launch(args)
    import parallelkit as pk

    pk.simulate_devices(args.devices)  # before anything starts JAX
    if args.command == "tour":
        from .tour import main as tour

        tour(args.model, args.steps, args.batch_size, args.json)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .distributed import LaunchError, launch

    try:
        launch(
            [sys.executable, args.script, *args.script_args],
            args.processes,
            args.devices_per_process,
            timeout=args.timeout,
            init_timeout=args.init_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            host=args.host,
        )
    except LaunchError as err:
        print(f"parallelkit launch: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
