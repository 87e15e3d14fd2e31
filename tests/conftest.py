import logging
import secrets

import pytest
from proc_support import leftovers
from store_support import TOKEN

from chorus.store import TCPStoreServer


@pytest.fixture(autouse=True)
def _quiet_chorus_logs(caplog):
    caplog.set_level(logging.ERROR, logger="chorus")
    yield


@pytest.fixture
def job(monkeypatch):
    """A fresh CHORUS_JOB_ID (segments of other jobs on this machine don't count); no
    shared-memory file of it may be left when the test ends."""
    job = "test" + secrets.token_hex(6)
    monkeypatch.setenv("CHORUS_JOB_ID", job)
    yield job
    assert not leftovers(job)


@pytest.fixture
def server():
    """A standalone TCP store server with the test token (the store tests use it)."""
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    yield srv
    srv.close()
