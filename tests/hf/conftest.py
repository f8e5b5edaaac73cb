"""Fixtures of the Hugging Face tests."""
import logging

import pytest

import lorafuse._logging


@pytest.fixture
def fallback_log(monkeypatch, caplog):
    """The once-per-process fallback messages, forgotten before the test so it sees its own."""
    monkeypatch.setattr(lorafuse._logging, "_said", set())
    caplog.set_level(logging.INFO, logger="lorafuse")
    return caplog
