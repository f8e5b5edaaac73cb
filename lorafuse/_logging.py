"""One logger for the package, and `log_once` for fallbacks that must be said once, not per call."""
import logging

logger = logging.getLogger("lorafuse")
_said: set[str] = set()


def log_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _said:
        _said.add(message)
        logger.log(level, message)
