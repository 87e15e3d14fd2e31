import threading

from chorus.transport.handles import Handle
from chorus.transport.matching import Arrival, Matcher
from chorus.wire.frames import Header, Kind

D = int(Kind.DATA)


def _hdr(tag=0, n=0):
    return Header(D, 0, tag, 0, n)


def test_posted_receives_match_in_order_per_source():
    m = Matcher()
    a, b = Handle(1, D, 0, 0), Handle(1, D, 0, 0)
    m.post(a)
    m.post(b)
    assert m.claim(1, _hdr()) is a
    assert m.claim(1, _hdr()) is b


def test_any_source_matches_first_arrival_and_specific_source_waits():
    m = Matcher()
    specific, anysrc = Handle(2, D, 0, 0), Handle(None, D, 0, 0)
    m.post(specific)
    m.post(anysrc)
    assert m.claim(3, _hdr()) is anysrc
    assert m.claim(2, _hdr()) is specific


def test_unexpected_messages_are_stashed_by_tag():
    m = Matcher()
    first = m.claim(1, _hdr(tag=7))
    second = m.claim(1, _hdr(tag=8))
    assert isinstance(first, Arrival) and isinstance(second, Arrival)
    m.arrival_ready(first, memoryview(b"x"))
    m.arrival_ready(second, memoryview(b"y"))
    assert m.post(Handle(1, D, 0, 8)) is second
    assert m.post(Handle(1, D, 0, 7)) is first


def test_claim_of_arrival_still_being_read_completes_later():
    m = Matcher()
    arrival = m.claim(1, _hdr(n=1))
    h = Handle(1, D, 0, 0)
    assert m.post(h) is None
    assert m.arrival_ready(arrival, memoryview(b"z")) is h


def test_claim_waits_briefly_for_a_post():
    m = Matcher()
    h = Handle(1, D, 0, 0)
    threading.Timer(0.01, m.post, args=(h,)).start()
    assert m.claim(1, _hdr(), wait=2.0) is h


def test_fail_where_fails_posted_and_claimed():
    m = Matcher()
    posted = Handle(1, D, 5, 0)
    other = Handle(1, D, 6, 0)
    m.post(posted)
    m.post(other)
    m.fail_where(lambda h: h.group == 5, lambda h: RuntimeError("gone"))
    assert posted.done() and str(posted.error) == "gone"
    assert not other.done()


def test_discard_where_drops_unclaimed_stashed_messages_only():
    m = Matcher()
    dropped, kept = m.claim(1, _hdr(tag=7)), m.claim(1, _hdr(tag=8))
    claimed = m.claim(1, _hdr(tag=9))  # still being read when its receive is posted: claimed
    m.arrival_ready(dropped, memoryview(b"x"))
    m.arrival_ready(kept, memoryview(b"y"))
    receive = Handle(1, D, 0, 9)
    assert m.post(receive) is None and claimed.claimant is receive
    m.discard_where(lambda a: a.header.tag in (7, 9))
    assert m.post(Handle(1, D, 0, 8)) is kept
    assert m.find_unexpected(lambda a: a.header.tag == 7) is None
    assert m.arrival_ready(claimed, memoryview(b"z")) is receive
