"""What chorus.cuda does while the caller's stream is capturing a CUDA graph
(``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``, ``torch.compile``'s
"reduce-overhead" mode).

A captured launch is replayed with the arguments it had at capture, so a kernel that took
its epoch and slot parity from the host would replay stale ones.  chorus's fused
all_reduce kernels, captured, count their launches and barriers on the device instead,
through slots and per-block words of their own (chorus.cuda.fused.graph_begin), so:

    capture:  all_reduce(x)   # every rank, in the same order, as for eager calls
    replay:   g.replay()      # every rank replays the same graphs in the same order

What may be captured: ``all_reduce`` (every reduce op and dtype the kernels take, any
size; from CHORUS_CUDA_NCCL_FROM_BYTES on it is NCCL's, which torch captures too).  The
group must have run a CUDA collective before the capture (its workspace is allocated and
mapped at the first one, which a capture cannot contain).  Any other op inside a capture
raises InvalidArgumentError before anything is enqueued.  A replay whose kernel gives up
(a lost peer, a timeout) writes why into the control page; the group's next eager call,
or ``check``, raises it.
"""

from __future__ import annotations

from chorus.errors import InvalidArgumentError

#: all_reduce algorithms whose kernels count on the device when captured
CAPTURABLE_ALL_REDUCE = frozenset({"one_shot", "two_shot", "two_shot_push", "two_shot_stores", "nccl"})


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph."""
    import torch

    try:
        return bool(torch._C._cuda_isCurrentStreamCapturing())
    except (AttributeError, RuntimeError):  # a torch built without CUDA
        return False


def first_use_error(group: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"the first CUDA collective on group {group} is inside a CUDA graph capture; chorus allocates and maps "
        "the group's GPU workspace at its first CUDA collective, which a capture cannot contain: run one "
        "collective on the group (e.g. an all_reduce of a small CUDA tensor) before capturing, as a warm-up")


def check(name: str, algorithm: str, group: str) -> None:
    """Raise InvalidArgumentError unless op ``name`` by ``algorithm`` can be captured."""
    if name == "all_reduce" and algorithm in CAPTURABLE_ALL_REDUCE:
        return
    what = f"all_reduce by algorithm {algorithm!r}" if name == "all_reduce" else name
    raise InvalidArgumentError(
        f"{what} on group {group} cannot be captured in a CUDA graph: of chorus's CUDA ops, only all_reduce "
        f"(algorithms {', '.join(sorted(CAPTURABLE_ALL_REDUCE))}) can; run {name} outside the capture")
