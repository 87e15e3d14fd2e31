"""What the flight recorder adds to each op of a shared-memory latency lane, measured
alone: the lane's bookkeeping (the sequence number appended, the clock compared and now
and then read, the ring cut back, the last op noted) run the way
chorus.components.shm runs it, around a stand-in op that does nothing, against the
same loop without it.  Prints nanoseconds per op, best of ``--repeat`` timings of
``--ops`` ops each; set the figure against an op's measured time (``chorus bench``) for
the recorder's share.

    python3 tools/flight_cost.py [--ops 1000000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import sys
import time

from chorus.debug import flight


def _op(seq: int) -> None:
    """The stand-in for the shared-memory exchange."""


def without(n: int) -> float:
    start = time.perf_counter()
    for seq in range(n):
        _op(seq)
    return time.perf_counter() - start


def with_recorder(n: int) -> float:
    ring = flight.Ring(0, "WORLD", (0, 1, 2, 3, 4, 5, 6, 7), 0, 2000)
    log = ring.lanes[0]
    start = time.perf_counter()
    for seq in range(n):  # chorus.components.shm's all_reduce lane, recorder on
        log.append(seq)
        if seq >= ring.clock_at:
            flight.tick(ring, seq)
        try:
            _op(seq)
        except BaseException as exc:
            flight.failed_lane(ring, seq, 0, exc)
            raise
        ring.done = seq
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    base = min(without(args.ops) for _ in range(args.repeat)) / args.ops
    rec = min(with_recorder(args.ops) for _ in range(args.repeat)) / args.ops
    print(f"python {sys.version.split()[0]}: loop {base * 1e9:.1f} ns/op, with the recorder {rec * 1e9:.1f} ns/op: "
          f"the recorder adds {(rec - base) * 1e9:.1f} ns/op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
