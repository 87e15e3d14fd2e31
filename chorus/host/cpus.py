"""The CPUs this process may use, and how many of the job's ranks share them: what
decides whether a waiting rank may poll (a poller takes the CPU from the rank it waits
for where ranks outnumber cores) and how many threads a rank splits its copies among."""

from __future__ import annotations

import os


def affinity() -> set[int]:
    """The CPUs this thread may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def quota() -> int | None:
    """The cgroup v2 CPU quota in whole CPUs (at least 1), or None when there is none."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            limit, period = f.read().split()
        if limit != "max":
            return max(1, int(limit) // int(period))
    except (OSError, ValueError):
        pass
    return None


def usable() -> int:
    """CPUs this process may use on its own: its affinity, at most its quota."""
    q = quota()
    n = len(affinity())
    return n if q is None else min(n, q)


def ranks_here(job_world: int) -> int:
    """The job's ranks on this host as the launcher counts them (LOCAL_WORLD_SIZE: a hint
    only, it decides no correctness), else all ``job_world`` of them."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) > 0 else job_world


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a kernel CPU list ("0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11})."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: set[int]) -> str:
    """``cpus`` as a kernel CPU list ({0, 1, 2, 3, 8} -> "0-3,8")."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cores(cpus: set[int], root: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """``cpus`` grouped by physical core (the kernel's thread_siblings_list of each), in
    order of each core's first CPU; a CPU the system says nothing of is a core alone
    ({0, 1, 64, 65}, where 64 and 65 are 0's and 1's second hardware threads:
    [[0, 64], [1, 65]])."""
    groups: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            with open(os.path.join(root, f"cpu{cpu}", "topology", "thread_siblings_list")) as f:
                first = min(parse_cpulist(f.read()) or {cpu})
        except (OSError, ValueError):
            first = cpu
        groups.setdefault(first, []).append(cpu)
    return [groups[first] for first in sorted(groups)]


def pci_local_cpus(domain: int, bus: int, device: int, root: str = "/sys/bus/pci/devices") -> set[int] | None:
    """The CPUs local to PCI device ``domain:bus:device`` (its NUMA node's, as the kernel
    lists them), or None where the system does not say."""
    try:
        with open(os.path.join(root, f"{domain:04x}:{bus:02x}:{device:02x}.0", "local_cpulist")) as f:
            return parse_cpulist(f.read()) or None
    except (OSError, ValueError):
        return None

