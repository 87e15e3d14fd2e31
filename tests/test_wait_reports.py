"""Waiting reports (CHORUS_WAIT_REPORT_S): an op that waits for a rank that is late logs
"still waiting for rank(s) [1] in all_reduce #N on group WORLD (... s)", over the
shared-memory window and over the transport.  The late rank enters only once the others
have logged (an Event set by the log handler), so the order of events is fixed."""

import logging
import re
import threading

import numpy as np
import pytest

import chorus as dist
from chorus import config
from chorus.testing import run_threads
from chorus.transport.handles import Handle
from chorus.transport.loopback import LoopbackFabric
from chorus.transport.waiting import WaitReport

pytestmark = pytest.mark.usefixtures("job")  # a job id of its own, no shared-memory file left

LINE = re.compile(r"chorus rank (\d+): still waiting for rank\(s\) \[(\d+)\] in (.+) on group (\S+) "
                  r"\((\d+(?:\.\d)?) s\)")


class Lines(logging.Handler):
    """Collects the chorus logger's waiting reports; ``seen(n)`` is set after n of them."""

    def __init__(self, wanted: int):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.wanted = wanted
        self.enough = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        # (a loaded machine can make set-up itself wait past the short interval: those
        # reports are right, and not what these tests look at)
        if "still waiting" in text and " in setting up " not in text:
            self.lines.append(text)
            if len(self.lines) >= self.wanted:
                self.enough.set()


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.WARNING, logger="chorus")
    handler = Lines(wanted=2)
    logger = logging.getLogger("chorus")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# Over the window every waiting rank misses rank 1 itself; over the transport a rank may
# wait for one that waits for rank 1 (its data comes through that rank), hence 2 ranks there.
@pytest.mark.parametrize("transport, world", [("auto", 3), ("tcp", 2)])
def test_a_late_rank_is_named_by_the_ranks_waiting_for_it(lines, transport, world):
    def body(rank, w):
        assert (dist.group.WORLD.shm is not None) == (transport == "auto")
        dist.barrier()
        if rank == 1:
            assert lines.enough.wait(20), lines.lines  # ranks 0 and 2 reported it first
        dist.all_reduce(np.ones(4))

    with config.override(CHORUS_WAIT_REPORT_S=0.05, CHORUS_TRANSPORT=transport):
        run_threads(body, world)
    reports = [LINE.fullmatch(line) for line in lines.lines]
    assert all(reports), lines.lines
    assert {m[1] for m in reports} <= {"0", "2"} and {m[2] for m in reports} == {"1"}, lines.lines
    assert {m[4] for m in reports} == {"WORLD"}, lines.lines
    assert all(re.fullmatch(r"all_reduce #\d+", m[3]) for m in reports), lines.lines


def test_a_receive_names_its_sender_and_tag(lines):
    def body(rank, w):
        group = dist.new_group([0, 1])
        if rank == 0:
            assert lines.enough.wait(20), lines.lines
            dist.send(np.ones(2), dst=1, tag=3, group=group)
        else:
            dist.recv(np.ones(2), src=0, tag=3, group=group)

    with config.override(CHORUS_WAIT_REPORT_S=0.05):
        run_threads(body, 2)
    reports = [LINE.fullmatch(line) for line in lines.lines]
    assert all(reports) and {(m[1], m[2], m[3]) for m in reports} == {("1", "0", "recv (tag 3)")}, lines.lines
    assert {m[4] for m in reports} == {"group1"}, lines.lines


def test_one_line_per_interval_per_group(caplog):
    caplog.set_level(logging.WARNING, logger="chorus")
    report = WaitReport(0, "WORLD", 60.0)
    assert report.line([1], "all_reduce #6", 30.0)
    assert not report.line([2], "barrier #7", 30.0)  # another thread of the group, same interval
    assert [r.getMessage() for r in caplog.records] == [
        "chorus rank 0: still waiting for rank(s) [1] in all_reduce #6 on group WORLD (30 s)"]
    assert WaitReport(3, "g", 1.0).line([], "recv (tag 0)", 1.25, any_source=True)
    assert caplog.records[-1].getMessage() == "chorus rank 3: still waiting for any rank in recv (tag 0) on group g (1.2 s)"


def test_reports_off_leave_a_wait_alone():
    """CHORUS_WAIT_REPORT_S=0 (and no rendezvous send): ``wait_long`` returns at once,
    leaving the whole wait to the plain one."""
    transport = LoopbackFabric(2).transport(0)
    transport.register_group(0, (0, 1), WaitReport(0, "WORLD", 0.0))
    never = Handle(1, 1, 0, 0)
    transport.wait_long(never, [never], None, lambda: "recv (tag 0)")
    assert not never.done()
