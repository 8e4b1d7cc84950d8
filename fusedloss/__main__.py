"""Command line: ``python -m fusedloss <command> [options]``.

Commands:
    demo    train a small model twice (PyTorch loss head vs fusedloss head) and compare;
            ``python -m fusedloss demo --help`` lists its options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command → (module implementing ``main(argv)``, one-line help). Modules load lazily so that
# ``--help`` stays fast and a command's dependencies are imported only when it runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "fusedloss.demo",
        "train a causal LM with the PyTorch and the fusedloss head; compare curves, memory, time",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """Top-level parser; each command's own options are parsed by its module's ``main``."""
    parser = argparse.ArgumentParser(
        prog="python -m fusedloss", description="fusedloss command line tools."
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        # add_help=False: ``demo --help`` reaches the command's own parser.
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to the chosen command's ``main``."""
    args, rest = build_parser().parse_known_args(argv)
    module_name, _ = COMMANDS[args.command]
    importlib.import_module(module_name).main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
