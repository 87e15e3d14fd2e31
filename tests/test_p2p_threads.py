"""Point-to-point between ranks running as threads over the loopback transport."""

import numpy as np
import pytest
from torch_support import needs_torch, torch

import chorus as dist
from chorus.testing import RankFailed, run_threads

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64",
          "complex64", "complex128"]


def _data(rank, n, dtype):
    rng = np.random.default_rng(rank * 1000 + n)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.startswith("complex"):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    return (rng.integers(0, 100, n)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_every_pair_exchanges_every_dtype(dtype, n):
    def body(rank, world):
        got = {}
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                if rank == src:
                    dist.send(_data(src * 10 + dst, n, dtype), dst=dst)
                elif rank == dst:
                    buf = np.empty(n, dtype)
                    assert dist.recv(buf, src=src) == src
                    got[src] = buf
        return got

    results = run_threads(body, 3)
    for dst, got in enumerate(results):
        for src, buf in got.items():
            np.testing.assert_array_equal(buf, _data(src * 10 + dst, n, dtype))


@needs_torch
@pytest.mark.parametrize("name", ["bfloat16", "float16", "bool", "complex64"])
def test_torch_tensors_including_bfloat16(name):
    dtype = getattr(torch, name)

    def body(rank, world):
        if rank == 0:
            dist.send(torch.arange(8).to(dtype), dst=1)
            return None
        t = torch.zeros(8, dtype=dtype)
        dist.recv(t, src=0)
        return t

    assert torch.equal(run_threads(body, 2)[1], torch.arange(8).to(dtype))


def test_non_contiguous_send_and_receive():
    def body(rank, world):
        if rank == 0:
            a = np.arange(16, dtype=np.int32).reshape(4, 4)
            dist.send(a[:, 1], dst=1)  # column: non-contiguous
            return None
        b = np.zeros((4, 4), np.int32)
        dist.recv(b[:, 3], src=0)
        return b

    b = run_threads(body, 2)[1]
    assert b[:, 3].tolist() == [1, 5, 9, 13] and b[:, :3].sum() == 0


@needs_torch
def test_non_contiguous_torch_send_and_receive():
    def body(rank, world):
        if rank == 0:
            dist.send(torch.arange(16, dtype=torch.float32).reshape(4, 4).t(), dst=1)
            return None
        t = torch.zeros(4, 4).t()
        dist.recv(t, src=0)
        return t

    assert torch.equal(run_threads(body, 2)[1], torch.arange(16, dtype=torch.float32).reshape(4, 4).t())


def test_any_source_receive_returns_each_sender():
    def body(rank, world):
        if rank == 0:
            seen = []
            for _ in range(world - 1):
                buf = np.zeros(1, np.int64)
                src = dist.recv(buf)
                assert buf[0] == src * 11
                seen.append(src)
            return sorted(seen)
        dist.send(np.array([rank * 11]), dst=0)

    assert run_threads(body, 5)[0] == [1, 2, 3, 4]


def test_tags_keep_streams_apart_and_order_is_kept_per_tag():
    def body(rank, world):
        if rank == 0:
            works = [dist.isend(np.array([tag * 100 + i]), dst=1, tag=tag) for i in range(3) for tag in (1, 2)]
            for w in works:
                w.wait()
            return None
        out = {}
        for tag in (2, 1):  # receive tag 2 first although tag 1 was sent first
            vals = []
            for _ in range(3):
                buf = np.zeros(1, np.int64)
                dist.recv(buf, src=0, tag=tag)
                vals.append(int(buf[0]))
            out[tag] = vals
        return out

    assert run_threads(body, 2)[1] == {1: [100, 101, 102], 2: [200, 201, 202]}


def test_isend_irecv_and_batch_isend_irecv_ring():
    def body(rank, world):
        send = np.full(4, rank, np.float64)
        recv = np.zeros(4, np.float64)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        req = dist.irecv(recv2 := np.zeros(2), src=(rank - 1) % world, tag=5)
        dist.isend(np.full(2, rank * 2.0), dst=(rank + 1) % world, tag=5).wait()
        assert req.wait() is True and req.is_completed() and req.is_success() and req.exception() is None
        return recv[0], recv2[0]

    assert run_threads(body, 4) == [(3.0, 6.0), (0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]


def test_work_future_resolves():
    def body(rank, world):
        if rank == 0:
            w = dist.isend(np.arange(3), dst=1)
        else:
            w = dist.irecv(np.zeros(3, np.int64), src=0)
        fut = w.get_future()
        doubled = fut.then(lambda f: [x * 2 for x in f.value()])
        w.wait()
        return doubled.wait()[0].tolist()

    assert run_threads(body, 2) == [[0, 2, 4], [0, 2, 4]]


def _expect_error(body, world, exc_type, match):
    with pytest.raises(RankFailed) as info:
        run_threads(body, world)
    err = info.value.errors[min(info.value.errors)]
    assert isinstance(err, exc_type), err
    assert match in str(err), str(err)


@pytest.mark.parametrize("call,match", [
    (lambda: dist.send(np.zeros(1), dst=5), "not a member"),
    (lambda: dist.send(np.zeros(1), dst=-1), "not a member"),
    (lambda: dist.send(np.zeros(1), dst=0), "this rank itself"),
    (lambda: dist.recv(np.zeros(1), src=0), "this rank itself"),
    (lambda: dist.send(np.zeros(1)), "required"),
    (lambda: dist.send(np.zeros(1), dst=1, group_dst=1), "not both"),
    (lambda: dist.send(np.zeros(1), dst=1, tag="x"), "tag"),
])
def test_bad_peers_raise_before_sending(call, match):
    def body(rank, world):
        if rank == 0:
            call()

    _expect_error(body, 2, ValueError, match)


def test_non_tensor_and_read_only_buffers_rejected():
    def body(rank, world):
        if rank == 0:
            dist.send([1, 2, 3], dst=1)

    _expect_error(body, 2, TypeError, "numpy.ndarray or a torch.Tensor")

    def readonly(rank, world):
        if rank == 0:
            a = np.zeros(2)
            a.flags.writeable = False
            dist.recv(a, src=1)

    _expect_error(readonly, 2, ValueError, "read-only")


def test_wrong_size_or_dtype_raises_on_receiver_and_sender_is_not_left_hanging():
    def body(rank, world):
        if rank == 0:
            dist.send(np.zeros(10, np.float32), dst=1)
            dist.send(np.ones(3, np.float32), dst=1)  # the next message still flows
            return "sent"
        with pytest.raises(dist.BufferMismatchError, match="40 bytes of float32.*32 bytes of float64"):
            dist.recv(np.zeros(4, np.float64), src=0)
        ok = np.zeros(3, np.float32)
        dist.recv(ok, src=0)
        return ok.tolist()

    assert run_threads(body, 2) == ["sent", [1.0, 1.0, 1.0]]


def test_ops_before_init_raise():
    with pytest.raises(dist.NotInitializedError, match="init_process_group"):
        dist.send(np.zeros(1), dst=1)
    with pytest.raises(ValueError, match="not initialized"):
        dist.get_rank()
    with pytest.raises(dist.NotInitializedError):
        dist.barrier()


def test_init_twice_raises():
    def body(rank, world):
        dist.init_process_group("chorus", init_method="env://")

    _expect_error(body, 1, ValueError, "already initialized")


def test_each_init_counts_in_keys_of_its_own_in_a_store_kept_across_inits():
    """A store kept across inits (a launcher's): what one init counted in the world's store
    (a group's CUDA attaches, chorus.cuda.setup) does not carry into the next init's."""
    from chorus.api.state import current
    from chorus.store import HashStore

    store, counts = HashStore(), []
    for _ in range(2):
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            counts.append(current().store.add("cuda/0/attaches", 1))
        finally:
            dist.destroy_process_group()
    assert counts == [1, 1]


def test_dead_peer_fails_pending_receive_everywhere():
    from chorus.transport.loopback import LoopbackFabric

    fabric = LoopbackFabric(3)

    def body(rank, world):
        if rank == 2:
            fabric.kill(2)
            return "killed"
        with pytest.raises(dist.PeerLostError, match="rank 2"):
            dist.recv(np.zeros(1), src=(rank + 1) % 2)  # waits on a live rank in a group with rank 2
        with pytest.raises(dist.PeerLostError):
            dist.barrier()
        return "raised"

    assert run_threads(body, 3, fabric=fabric) == ["raised", "raised", "killed"]


def test_timeout_names_op_and_missing_peer():
    import time

    def body(rank, world):
        pg = dist.new_group([0, 1], timeout=0.3)
        if rank == 0:
            started = time.monotonic()
            with pytest.raises(dist.CommTimeoutError, match=r"recv from rank 1 .*no answer from ranks \[1\]"):
                dist.recv(np.zeros(1), src=1, group=pg)
            return time.monotonic() - started
        time.sleep(1.0)  # alive but silent
        return 0.0

    elapsed = run_threads(body, 2)[0]
    assert 0.25 < elapsed < 1.0


def test_short_wait_timeout_leaves_the_receive_pending():
    import threading

    go = threading.Event()

    def body(rank, world):
        if rank == 1:
            go.wait(10)
            dist.send(np.array([42]), dst=0)
            return None
        buf = np.zeros(1, np.int64)
        work = dist.irecv(buf, src=1)
        with pytest.raises(TimeoutError, match=" Timed out "):  # torch's word, as in gloo's errors
            work.wait(timeout=0.05)
        assert not work.is_completed()
        go.set()
        work.wait()
        return int(buf[0])

    assert run_threads(body, 2)[0] == 42


def _irecv_posts(rank, world):
    """Rank 0's irecvs from rank 1: 16 bytes, WAITER_READS_MAX + 4 bytes, 16 bytes from any
    source; how each was posted (``waited``) and what arrived."""
    t = dist.group.WORLD.transport
    small, large = np.zeros(4, np.float32), np.zeros(t.WAITER_READS_MAX // 4 + 1, np.float32)
    anyone = np.zeros(4, np.float32)
    posted = []
    if rank == 0:
        post = t.irecv

        def recording(*args, **kw):
            posted.append(kw.get("waited"))
            return post(*args, **kw)

        t.irecv = recording
        works = [dist.irecv(small, src=1), dist.irecv(large, src=1), dist.irecv(anyone)]
        t.irecv = post
    else:
        works = [dist.isend(small + 1, dst=0), dist.isend(large + 2, dst=0), dist.isend(small + 3, dst=0)]
    for w in works:
        w.wait()
    return type(t).__name__, posted, float(small[0]), float(large[-1]), float(anyone[0])


@pytest.mark.parametrize("mode, small_waited", [("buffered", True), ("rendezvous", False)])
def test_a_small_irecv_is_left_to_its_waiter_and_others_to_the_reader_threads(mode, small_waited, monkeypatch):
    """Over TCP (processes), an irecv of up to WAITER_READS_MAX bytes from one peer posts its
    receive as waited (the thread waiting for its Work reads it; a parked reader thread is
    not woken to race it for the message).  Not a larger one, nor one from any source (a
    waiting thread reads one connection), nor any under rendezvous sends (whose sender
    waits for this rank to read the frame, while this rank may wait on another op first):
    posting those wakes the reader threads."""
    from chorus.testing import run_processes

    monkeypatch.setenv("CHORUS_SEND_MODE", mode)
    got = run_processes(_irecv_posts, 2)
    assert got[0] == ("TcpTransport", [small_waited, False, False], 1.0, 2.0, 3.0), got[0]


class _Handle:
    receive, peer = True, 1

    def __init__(self, done):
        self._done = done

    def done(self):
        return self._done

    def add_done_callback(self, fn):
        pass


def test_polling_or_a_future_wakes_the_reader_threads_for_a_waiters_receive():
    """A Work whose receive is left to its waiter: is_completed() and get_future() ask the
    transport to complete it without one (Transport.attend), so polling never waits for
    a parked reader thread's timeout; a finished Work asks nothing."""
    from chorus.work import HandleWork

    class Transport:
        attended = []

        def attend(self, handles):
            self.attended.append([h.done() for h in handles])

    transport = Transport()
    pending = HandleWork(transport, [_Handle(False)], None, lambda: "irecv")
    assert not pending.is_completed()
    pending.get_future()
    assert transport.attended == [[False], [False]]
    finished = HandleWork(transport, [_Handle(True)], None, lambda: "irecv")
    transport.attended.clear()
    assert finished._poll() and transport.attended == []
