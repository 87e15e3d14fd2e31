"""Fault campaigns against real chorus jobs on this machine, each a subcommand that
prints (or writes, with ``--out``) a JSON result whose header holds the command line:

  flood      idle and slow connections to every port the ranks listen on, during set-up,
             under a lowered open-file limit: does the job set up and finish right, and
             does every handshake thread end by the handshake deadline?
  threads    two threads of each rank calling all_reduce on one group: wrong results?
  kills      jobs under torchrun, chorus.spawn, torch's mp.spawn and by hand, one rank or
             all killed with SIGKILL at a seeded random moment: chorus files left in /dev/shm?
  partition  two ranks in two network namespaces, the link cut during 64 MiB all_reduces
             (root and iproute2): how long until every rank raises?
  soak       random collectives and point-to-point ops, whole jobs killed and restarted at
             random: wrong results, and the ranks' descriptors and threads over time

usage: python3 tools/fault_campaign.py SUBCOMMAND [options] [--out FILE]
       python3 tools/fault_campaign.py SUBCOMMAND --help
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # chorus from this checkout

from faults.common import write_result  # noqa: E402 - after the path

CAMPAIGNS = ("flood", "threads", "kills", "partition", "soak")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fault_campaign.py", description=__doc__.split("\n\n")[0])
    subs = parser.add_subparsers(dest="campaign", required=True)
    modules = {}
    for name in CAMPAIGNS:
        module = importlib.import_module(f"faults.{name}")
        sub = subs.add_parser(name, help=module.__doc__.split("\n\n")[0].replace("\n", " "))
        module.add_arguments(sub)
        sub.add_argument("--out", help="write the JSON result here (else print it)")
        modules[name] = module
    args = parser.parse_args(argv)
    result = modules[args.campaign].run(args)
    write_result(args.out, argv, result)
    return 0 if result.get("summary", {}).get("met", True) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
