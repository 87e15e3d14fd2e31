import pytest
from hypothesis import given
from hypothesis import strategies as st

from chorus.errors import ProtocolError
from chorus.wire.frames import (
    HEADER_SIZE,
    Header,
    Kind,
    abort_parties,
    abort_tag,
    pack_fields,
    pack_header,
    unpack_header,
)


@given(kind=st.sampled_from([Kind.DATA, Kind.COLL]), group=st.integers(0, 2**32 - 1),
       tag=st.integers(-(2**63), 2**63 - 1), seq=st.integers(0, 2**64 - 1),
       nbytes=st.integers(0, 2**40), dtype=st.integers(0, 15), fp=st.integers(0, 2**64 - 1))
def test_header_round_trip(kind, group, tag, seq, nbytes, dtype, fp):
    h = Header(int(kind), group, tag, seq, nbytes, dtype, fp)
    data = pack_header(h)
    assert len(data) == HEADER_SIZE
    assert unpack_header(data) == h


def test_rejects_bad_magic_version_kind_and_sizes():
    good = bytearray(pack_header(Header(int(Kind.DATA), 0, 0, 0, 10, 12, 0)))
    for index, value, message in [(0, ord("X"), "magic"), (2, 99, "version"), (3, 77, "kind"),
                                  (4, 200, "dtype"), (5, 1, "reserved")]:
        bad = bytearray(good)
        bad[index] = value
        with pytest.raises(ProtocolError, match=message):
            unpack_header(bytes(bad))
    with pytest.raises(ProtocolError, match="bytes"):
        unpack_header(bytes(good[:-1]))
    with pytest.raises(ProtocolError, match="no payload"):
        unpack_header(pack_header(Header(int(Kind.HEARTBEAT), 0, 0, 0, 5)))


@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_random_bytes_parse_or_raise_protocol_error(data):
    try:
        h = unpack_header(data)
    except ProtocolError:
        return
    assert pack_header(h) == data


@given(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 2), st.integers(0, 2**31 - 1))
def test_abort_tag_carries_culprit_and_detector_and_an_old_style_tag_means_the_sender(culprit, detector, sender):
    tag = abort_tag(culprit, detector)
    assert 0 <= tag < 2**63  # fits the header's signed tag field
    assert abort_parties(tag, sender) == (culprit, detector)
    assert abort_parties(culprit, sender) == (culprit, sender)
    assert unpack_header(pack_fields(int(Kind.ABORT), 1, tag, 3, 0, 0, 5)).tag == tag
