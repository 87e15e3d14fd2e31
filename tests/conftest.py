import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_chorus_logs(caplog):
    caplog.set_level(logging.ERROR, logger="chorus")
    yield
