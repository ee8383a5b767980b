"""The library's logger.

Every module logs through ``logger`` (the ``"torchtitan"`` logger). ``init_logger`` installs exactly one
stream handler on it whose format carries a per-rank prefix, so a line read from rank 7's output says what
rank 7 is, e.g.::

    [titan] 2025-01-01 12:00:00,000 INFO [rank 7 pp=3 dp_shard=0 tp=1] step: 10 loss: 7.41 ...

``init_logger`` may be called again (for instance once the device mesh, and so the rank's coordinates, is
known): the handler it installed before is replaced, never stacked, so no line is printed twice.

The level comes from the environment variable ``LOGLEVEL`` (a name such as ``DEBUG``/``info`` or a number),
``INFO`` when unset. The logger still propagates to the root logger, which normally has no handler; this
keeps ``pytest``'s ``caplog`` and user-installed root handlers working. (A program that also configures the
root logger with a stream handler, e.g. via ``logging.basicConfig``, will see each line twice.)
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["logger", "init_logger", "warn_once"]

logger = logging.getLogger("torchtitan")

_FORMAT = "[titan] %(asctime)s %(levelname)s {prefix}%(message)s"
# Marks the handler installed by init_logger so a later call can find and replace it.
_HANDLER_TAG = "_torchtitan_handler"
_warned: set[str] = set()


def _level_from_env() -> int:
    raw = os.environ.get("LOGLEVEL", "").strip()
    if not raw:
        return logging.INFO
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    if isinstance(level, int):
        return level
    # Unknown name: keep INFO and say so once the handler exists.
    return -1


def init_logger(prefix: str = "") -> logging.Logger:
    """Configure ``logger`` with a single stream handler (stdout) and return it.

    Args:
        prefix: text put right before each message, e.g. ``"[rank 3 pp=1 dp_shard=0 tp=1] "``. Include the
            trailing space yourself. ``%`` characters are escaped, so any text is safe.

    Calling it again replaces the handler installed by the previous call (to change the prefix or pick up a
    new ``LOGLEVEL``); handlers added by other code are left alone.
    """
    level = _level_from_env()
    bad_level = level == -1
    if bad_level:
        level = logging.INFO

    for handler in list(logger.handlers):
        if getattr(handler, _HANDLER_TAG, False):
            logger.removeHandler(handler)
            handler.close()

    handler = logging.StreamHandler(sys.stdout)
    setattr(handler, _HANDLER_TAG, True)
    handler.setFormatter(logging.Formatter(_FORMAT.format(prefix=prefix.replace("%", "%%"))))
    handler.setLevel(level)
    logger.addHandler(handler)
    logger.setLevel(level)

    if bad_level:
        logger.warning("LOGLEVEL=%r is not a logging level; using INFO", os.environ.get("LOGLEVEL"))
    return logger


def warn_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time this exact message is seen in this process."""
    if msg in _warned:
        return
    _warned.add(msg)
    logger.warning(msg, stacklevel=2)
