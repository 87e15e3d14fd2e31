import logging

import pytest
from store_support import TOKEN

from chorus.store import TCPStoreServer


@pytest.fixture(autouse=True)
def _quiet_chorus_logs(caplog):
    caplog.set_level(logging.ERROR, logger="chorus")
    yield


@pytest.fixture
def server():
    """A standalone TCP store server with the test token (the store tests use it)."""
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    yield srv
    srv.close()
