"""``ReduceLane``: what every all_reduce latency lane does around its own plan and run.

A lane is a component's shortcut for a synchronous all_reduce of a small numpy array (or
torch CPU tensor): the API calls ``all_reduce_now`` first, and the lane either runs the
op now, from a plan made once per (dtype, shape, op), or answers False and the general
path runs it (with the same result, or the same error).  Both lanes (the shared-memory
window's, chorus.components.shm, and the TCP one, chorus.components.tcp_lane) share:

* the plan cache: the last plan kept with the dtype, shape and op it was made for,
  compared by identity where that is exact, the others looked up;
* stepping aside while the group has queued async ops, a recorder listens, another
  thread is inside the group's collectives, or the array is not C-contiguous, aligned
  and writeable;
* the group's entry and sequence number, taken as the general path takes them;
* the flight recorder: the plan and the sequence numbers the lane ran, a failure noted;
* AVG's division after the sum; torch tensors through a cached numpy view.

A subclass gives ``_reduce_plan(arr, op)`` (a plan with an ``average`` flag, or False),
``_reduce_run(seq, plan, arr)`` (run the op as op ``seq`` of the group, raising chorus's
error) and ``_lane_open()`` (False once the lane's resources are gone).
"""

from __future__ import annotations

import numpy as np

from chorus import recorder
from chorus.buffers import Buffer, as_buffer
from chorus.errors import InvalidArgumentError, InvalidTensorError
from chorus.reductions import ReduceOp, check_op, divide

#: plans kept per group before the cache starts over
PLANS = 256
#: a torch CPU tensor of up to this many bytes keeps its numpy view between calls (making
#: one costs about a microsecond; the view keeps the tensor's memory until another replaces it)
TENSOR_VIEW_BYTES = 1 << 16


class ReduceLane:
    """The all_reduce lane of group ``pg`` (see the module docstring)."""

    def _lane_init(self, pg, reduce_log, reduce_keys) -> None:
        """``reduce_log``/``reduce_keys``: the flight recorder's lists for this lane (None
        when the group has no recorder)."""
        self.pg = pg
        self.plans: dict = {}
        self.last_reduce = None  # (dtype, op, shape, plan): the last all_reduce plan used
        self.tensor_view = None  # (tensor, its data_ptr, numpy view): the last small torch tensor
        self.reduce_log, self.reduce_keys = reduce_log, reduce_keys

    def _lane_open(self) -> bool:
        return True

    def _plan_start(self, arr: np.ndarray, op) -> Buffer | None:
        """Begin ``_reduce_plan`` for ``arr`` and ``op``: the cache makes room and notes that
        there is no plan yet (a call the lane cannot take is not looked at again); the
        array as a Buffer, or None where the general path must take the call (it raises
        the argument's error)."""
        if len(self.plans) >= PLANS:
            self.plans.clear()
        self.plans[(arr.dtype, arr.shape, op.name)] = False
        try:
            buf = as_buffer(arr, op="all_reduce")
            check_op(op, buf.dtype, "all_reduce")
        except (InvalidArgumentError, InvalidTensorError):
            return None
        return buf

    def forget_plans(self) -> None:
        """Drop the cached plans (made again at the next call)."""
        self.plans.clear()
        self.last_reduce = self.tensor_view = None

    def all_reduce_now(self, arr: np.ndarray, op) -> bool:
        """all_reduce of ``arr`` (a numpy array) now, from a cached plan: True if done;
        False if the general path must take it (it gives the same result or error).
        Every check is one a repeated call needs; ``flags.carray`` is C-contiguous,
        aligned and writeable in one read."""
        last = self.last_reduce
        if last is not None and last[0] is arr.dtype and last[1] is op and last[2] == arr.shape:
            plan = last[3]
        else:
            if type(op) is not ReduceOp.RedOpType or not self._lane_open():
                return False
            plan = self.plans.get((arr.dtype, arr.shape, op.name))
            if plan is None:
                plan = self._reduce_plan(arr, op)
            if not plan:
                return False
            last = self.last_reduce = (arr.dtype, op, arr.shape, plan)
            if self.reduce_keys is not None:  # the flight recorder: the lane's ops from here run this plan
                self.reduce_keys.append((len(self.reduce_log), last))
        pg = self.pg
        if pg.queue or recorder.current is not None or not arr.flags.carray:
            return False
        if not pg.lane_op(self.flight, self.reduce_log, self._reduce_run, plan, arr):
            return False
        if plan.average:
            divide(arr, arr.dtype.name, pg.size())
        return True

    def held_tensor_now(self, t, op) -> bool | None:
        """all_reduce_tensor_now for ``t`` if it is the torch CPU tensor whose numpy view
        this lane keeps (the last small one it reduced): True done, False the general
        path must take it; None for any other object (nothing done: not even its type is
        looked at, so that a repeated call of a tensor costs only these checks)."""
        view = self.tensor_view
        if view is None or view[0] is not t:
            return None
        if view[1] == t.data_ptr() and view[2].size == t.numel():
            return self.all_reduce_now(view[2], op)
        return self.all_reduce_tensor_now(t, op)

    def all_reduce_tensor_now(self, t, op) -> bool:
        """all_reduce_now for a torch CPU tensor ``t``, through a numpy view of its memory
        (the same plans, results and errors); False where numpy has no view of it (bfloat16,
        a tensor that requires grad, a conjugate view...) or the lane steps aside."""
        view = self.tensor_view
        if view is not None and view[0] is t and view[1] == t.data_ptr() and view[2].size == t.numel():
            return self.all_reduce_now(view[2], op)
        try:
            arr = t.numpy()
        except (RuntimeError, TypeError):
            return False
        if arr.nbytes <= TENSOR_VIEW_BYTES:
            self.tensor_view = (t, t.data_ptr(), arr)
        return self.all_reduce_now(arr, op)
