"""Command line: ``python -m parallelkit tour [--devices N] [--model mlp|cnn] [--steps K]``."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import parallelkit as pk

    pk.simulate_devices(args.devices)  # before anything starts JAX
    if args.command == "tour":
        from .tour import main as tour

        tour(args.model, args.steps, args.batch_size, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
