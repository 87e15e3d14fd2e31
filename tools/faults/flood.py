"""Connections that never authenticate, during a job's set-up: a flood of idle ones and
a slow-loris (a valid handshake, one byte every few seconds), against every port the
ranks listen on, with the ranks' open-file limit lowered.

Rank 0 starts alone (its store listens on MASTER_PORT); the attacker watches the ranks'
listening ports through /proc and, as each appears (the store's at once, each
transport's once every rank has joined), opens ``--connections`` idle connections and
``--loris`` slow ones to it, never more.  ``--delay`` seconds after the store's port was
attacked, the other ranks start.  Every rank then runs ``--ops`` checked collectives,
rank 0 stays ``--hold`` seconds more (the slow connections are cut meanwhile), and all
leave.  Each rank samples its threads and descriptors (tools/faults/jobs/sampler.py):
no handshake thread may live longer than the handshake deadline.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import selectors
import socket
import tempfile
import threading
import time

from chorus.wire.handshake import ClientHandshake
from faults.common import job_env, listening_ports, reserved_port, start_rank

HANDSHAKE_S = 10.0  # chorus's default CHORUS_HANDSHAKE_TIMEOUT


def add_arguments(p) -> None:
    p.add_argument("--connections", type=int, default=1100, help="idle connections per listening port")
    p.add_argument("--loris", type=int, default=500, help="slow connections per listening port")
    p.add_argument("--interval", type=float, default=8.0, help="seconds between a slow connection's bytes")
    p.add_argument("--nofile", type=int, default=1024, help="the ranks' soft open-file limit")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", type=int, default=200, help="checked collectives per rank (all_reduce + broadcast)")
    p.add_argument("--delay", type=float, default=2.0, help="seconds between the attack on the store and the other ranks' start")
    p.add_argument("--hold", type=float, default=15.0, help="seconds rank 0 stays after its ops")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the job may take in all")


class Attack:
    """Idle and slow connections to the ports that appear on the watched processes."""

    def __init__(self, connections: int, loris: int, interval: float):
        self.connections, self.loris, self.interval = connections, loris, interval
        self.hello = ClientHandshake(None, b"store").initial_bytes()  # a valid start, no token
        self.sel = selectors.DefaultSelector()
        self.ports: dict[int, dict] = {}  # port -> counts and times
        self.socks: dict[socket.socket, list] = {}  # sock -> [port, kind, opened at, bytes sent]
        self.first_attack = threading.Event()
        self.stop = threading.Event()
        self.pids: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, port: int, kind: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        code = s.connect_ex(("127.0.0.1", port))
        stats = self.ports[port]
        if code not in (0, errno.EINPROGRESS):
            stats["connect_failed"] += 1
            s.close()
            return
        self.socks[s] = [port, kind, time.monotonic(), 0]
        self.sel.register(s, selectors.EVENT_READ)
        stats[f"{kind}_opened"] += 1

    def _attack(self, port: int) -> None:
        self.ports[port] = {"found_at_s": round(time.monotonic() - self.t0, 2), "idle_opened": 0,
                            "loris_opened": 0, "connect_failed": 0, "idle_closed_after_s": [],
                            "loris_closed_after_s": []}
        for _ in range(self.connections):
            self._open(port, "idle")
        for _ in range(self.loris):
            self._open(port, "loris")
        self.first_attack.set()

    def _run(self) -> None:
        self.t0 = next_byte = time.monotonic()
        while not self.stop.is_set():
            for pid in list(self.pids):
                for port in listening_ports(pid) - self.ports.keys():
                    self._attack(port)
            for key, _ in self.sel.select(0.02):  # readable: the server closed it (EOF or reset)
                s = key.fileobj
                port, kind, opened, _ = self.socks.pop(s)
                self.sel.unregister(s)
                s.close()
                self.ports[port][f"{kind}_closed_after_s"].append(round(time.monotonic() - opened, 2))
            if time.monotonic() >= next_byte:
                next_byte += self.interval
                for s, state in list(self.socks.items()):
                    if state[1] == "loris" and state[3] < len(self.hello) - 1:  # never the last byte
                        try:
                            state[3] += s.send(self.hello[state[3]:state[3] + 1])
                        except OSError:
                            pass  # not connected yet (still in the listen backlog), or closed

    def summary(self) -> dict:
        out = {}
        for port, st in self.ports.items():
            row = {k: v for k, v in st.items() if not k.endswith("_after_s")}
            for kind in ("idle", "loris"):
                closed = sorted(st[f"{kind}_closed_after_s"])
                row[f"{kind}_closed"] = len(closed)
                row[f"{kind}_still_open"] = sum(1 for v in self.socks.values() if v[0] == port and v[1] == kind)
                if closed:
                    row[f"{kind}_closed_after_s"] = {"min": closed[0], "median": closed[len(closed) // 2],
                                                    "max": closed[-1]}
            out[str(port)] = row
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def run(args) -> dict:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own sockets
    job = "flood" + secrets.token_hex(4)
    attack = Attack(args.connections, args.loris, args.interval)
    with tempfile.TemporaryDirectory(prefix="chorus-flood-") as out:
        env = job_env(job, FLOOD_TIMEOUT=str(args.timeout))
        rank_args = [out, str(args.ops), str(args.hold)]
        with reserved_port() as port:
            procs = [start_rank("flood_rank.py", rank_args, env, 0, args.world, port, args.nofile)]
        attack.pids.append(procs[0].pid)
        attack.thread.start()
        began = time.monotonic()
        if not attack.first_attack.wait(30):
            raise RuntimeError("rank 0 never listened")
        time.sleep(args.delay)
        procs += [start_rank("flood_rank.py", rank_args, env, r, args.world, port, args.nofile)
                  for r in range(1, args.world)]
        attack.pids.extend(p.pid for p in procs[1:])
        deadline = time.monotonic() + args.timeout
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a hang is a result: kill and report
                p.kill()
                p.wait()
        took = time.monotonic() - began
        attack.close()
        ranks = []
        for r in range(args.world):
            path = os.path.join(out, f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "ok": False})
    ok = all(r.get("ok") for r in ranks) and all(p.returncode == 0 for p in procs)
    wrong = sum(r.get("wrong", 0) for r in ranks)
    longest = max(r.get("admit_longest_s", 0.0) for r in ranks)
    summary = {"job_set_up_and_finished": ok, "wrong_results": wrong,
               "ops_checked": sum(r.get("ops", 0) for r in ranks),
               "set_up_s": [r.get("setup_s") for r in ranks],
               "longest_handshake_thread_s": longest, "handshake_deadline_s": HANDSHAKE_S,
               "no_thread_outlived_the_deadline": longest <= HANDSHAKE_S + 0.5,
               "most_descriptors": [r.get("most_descriptors") for r in ranks], "open_file_limit": args.nofile,
               "most_threads": [r.get("most_threads") for r in ranks], "seconds": round(took, 1)}
    summary["met"] = ok and wrong == 0 and summary["no_thread_outlived_the_deadline"]
    return {"summary": summary, "ports": attack.summary(),
            "ranks": [{**r, "exit_code": p.returncode} for r, p in zip(ranks, procs, strict=True)]}
