"""The shared-memory window of a group whose members all share a host (chorus.shm).

It supports every collective unless the call names an algorithm (``algorithm=`` or the
group's ``CHORUS_ALGO_<COLLECTIVE>``: those are TCP schedules).  The window runs one op at
a time in its own sequence of syncs (chorus.shm.group.ShmGroup).

Two latency lanes skip the Call altogether, because building one is a visible share of
the op they serve: a synchronous ``all_reduce`` of a numpy array that runs one-shot or
reduce-scatter + all-gather in one chunk of the window (``all_reduce_now``; a torch CPU tensor through a numpy view of its memory,
``all_reduce_tensor_now``) and a synchronous ``all_to_all_single`` of numpy arrays in equal
blocks that fit one round of the window (``all_to_all_now``).  Each keeps a plan per
(dtype, shape, op), here, and runs from it: the same algorithm, bits and sequence number
as the general path, with the op's context built only to wait or to raise.  They step
aside (return False) whenever the general path is needed: queued async ops, a recorder
listener, an argument the plan does not cover.  They note each op in the group's flight
recorder themselves (chorus.debug.flight: its sequence number, the plan on a change of
plan, the last op that returned), since a recorder listener would send them aside.
"""

from __future__ import annotations

import functools

import numpy as np

from chorus import recorder
from chorus.buffers import as_buffer
from chorus.call import Call
from chorus.components.base import Component, run_in_order
from chorus.components.lane import PLANS, ReduceLane
from chorus.debug import flight
from chorus.errors import InvalidArgumentError, InvalidTensorError
from chorus.reductions import row_reducer, rows_into
from chorus.selection import without_hierarchy
from chorus.wire.fingerprint import fingerprint
from chorus.work import Work


class ShmComponent(ReduceLane, Component):
    """The group ``pg``'s window ``shm`` (a chorus.shm.group.ShmGroup).  ``forced``: the
    collectives whose algorithm the group's settings name (they go to TCP schedules)."""

    name = "shm"

    def __init__(self, pg, shm, forced: frozenset[str] = frozenset()):
        self.shm = shm
        self.tcp_only = forced
        self.last_exchange = None  # (dtype, shape, plan): the last all_to_all plan used
        self.flight = ring = flight.attach(pg)  # the group's flight recorder, or None (turned off)
        self._lane_init(pg, *(ring.lanes[0], ring.keys[0]) if ring is not None else (None, None))
        self.exchange_log, self.exchange_keys = (ring.lanes[1], ring.keys[1]) if ring is not None else (None, None)

    def supports(self, call: Call) -> str | None:
        if call.name in self.tcp_only:
            return None
        if call.algorithm is None or without_hierarchy(call.name, call.algorithm) is None:
            return "window"  # ("hierarchical" on one host: no preference, the window)
        return None

    def start(self, call: Call, algorithm: str) -> Work | None:
        reduce = row_reducer(call.reduce_op, call.dtype) if call.reduce_op else None
        shm = self.shm
        return run_in_order(call, self.name, algorithm,
                            lambda ctx: shm.run(call.name, ctx, call.buffers, reduce, call.root, call.args))

    def close(self) -> None:
        self.forget_plans()  # their views of the window would keep it mapped
        self.shm.close()

    def forget_plans(self) -> None:
        """Drop the latency lanes' plans (made again at the next call): for a window whose
        settings changed under them."""
        super().forget_plans()
        self.last_exchange = None

    # -- latency lanes ---------------------------------------------------------------------
    def _lane_open(self) -> bool:
        return not self.shm.closed

    def _reduce_run(self, seq: int, plan, arr: np.ndarray) -> None:
        self.shm.all_reduce_planned(self.pg, seq, plan, arr)

    def _reduce_plan(self, arr: np.ndarray, op):
        """The cached chorus.shm.group.Planned for ``arr``'s dtype and shape and ``op``, or False."""
        buf = self._plan_start(arr, op)
        if buf is None or "all_reduce" in self.tcp_only or op.name == "PREMUL_SUM":
            return False
        plan = self.shm.all_reduce_plan(arr.dtype, arr.shape, functools.partial(rows_into, op.name, buf.dtype),
                                      fingerprint("all_reduce", buf.dtype, buf.numel, -1, op.name),
                                      op.name == "AVG", row_reducer(op.name, buf.dtype))
        plan = self.plans[(arr.dtype, arr.shape, op.name)] = plan or False
        return plan

    def all_to_all_now(self, out: np.ndarray, inp: np.ndarray) -> bool:
        """all_to_all_single of ``inp`` into ``out`` (numpy arrays, equal blocks) now, from a
        cached plan: True if done, False if the general path must take it."""
        if out.dtype is not inp.dtype or out.shape != inp.shape:
            return False
        if not (inp.flags.c_contiguous and out.flags.carray) or np.may_share_memory(inp, out):
            return False
        last = self.last_exchange
        if last is not None and last[0] is inp.dtype and last[1] == inp.shape:
            plan = last[2]
        else:
            if self.shm.closed:
                return False
            plan = self.plans.get(("all_to_all", inp.dtype, inp.shape))
            if plan is None:
                plan = self._exchange_plan(inp)
            if not plan:
                return False
            last = self.last_exchange = (inp.dtype, inp.shape, plan)
            if self.flight is not None:
                self.exchange_keys.append((len(self.exchange_log), last))
        pg = self.pg
        if pg.queue or recorder.current is not None:
            return False
        return pg.lane_op(self.flight, self.exchange_log, self._exchange_run, plan, inp, out)

    def _exchange_run(self, seq: int, plan, inp: np.ndarray, out: np.ndarray) -> None:
        self.shm.all_to_all_fast(self.pg, seq, plan, inp, out)

    def _exchange_plan(self, inp: np.ndarray):
        """The cached Exchange for ``inp``'s dtype and shape, or False."""
        if len(self.plans) >= PLANS:
            self.plans.clear()
        key = ("all_to_all", inp.dtype, inp.shape)
        self.plans[key] = False
        if "all_to_all" in self.tcp_only or inp.ndim == 0 or inp.shape[0] % self.pg.size():
            return False
        try:
            buf = as_buffer(inp, op="all_to_all_single", what="input")
        except (InvalidArgumentError, InvalidTensorError):
            return False  # the general path raises it
        if buf.copied:
            return False  # (the general path copies it)
        plan = self.shm.all_to_all_plan(inp.dtype, inp.size, fingerprint("all_to_all", buf.dtype, 0, -1, ""))
        self.plans[key] = plan or False
        return self.plans[key]
