"""The ``pdserve`` command: one subcommand per component.

Each component owns its flags in ``pdserve/<component>/cli.py`` (``configure(parser)`` and
``run(args) -> int``). Modules are imported only for the chosen subcommand, so
``pdserve proxy`` never loads kopf or the Kubernetes client.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pdserve import __version__

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "proxy": ("pdserve.proxy.cli", "run the P/D router in front of prefill and decode vLLM instances"),
    "sim": ("pdserve.sim.cli", "run a fake vLLM server with P/D and data-parallel semantics"),
    "operator": ("pdserve.operator.cli", "run the Kubernetes operator for PDDeployment objects"),
    "render": (
        "pdserve.deployment.cli",
        "print every manifest of a PDDeployment file, or with `sidecar` what a client pod needs to run "
        "the router next to itself; without a cluster",
    ),
    "up": ("pdserve.local.cli", "run a PDDeployment on this machine, without Kubernetes"),
    "bench": (
        "pdserve.loadgen.cli",
        "measure a server from the outside: `bench replay` replays a Mooncake trace or a Poisson workload",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=(
            "Prefill/decode disaggregated serving for vLLM. Run `pdserve <command> --help` for details."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)

    # Parse only the command name first, then let the component build its own parser.
    first = parser.parse_args(args_list[:1] if args_list and not args_list[0].startswith("-") else args_list)
    if first.command is None:
        parser.print_help()
        return 2
    module_name, help_text = SUBCOMMANDS[first.command]
    module = importlib.import_module(module_name)
    component = argparse.ArgumentParser(
        prog=f"pdserve {first.command}",
        description=(module.__doc__ or help_text).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(component)
    args = component.parse_args(args_list[1:])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
