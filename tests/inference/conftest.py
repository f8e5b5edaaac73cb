"""Fixtures of the inference tests."""
from tests.hf.conftest import fallback_log  # noqa: F401  (the once-per-process log, forgotten per test)
