"""``fastlock serve --log-format json``: one JSON object per log line.

Each line is an object with ``time`` (ISO-8601 UTC, milliseconds), ``level``,
``logger`` and ``message``, then whichever of :data:`CONTEXT_FIELDS` the log call
attached with ``extra=`` (the session, the client name, the lock, the fencing token,
the correlation id, the principal), and ``exception`` (the formatted traceback) when
there is one.  Values that JSON cannot hold are written as their ``str``.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import TextIO

__all__ = ["CONTEXT_FIELDS", "JsonFormatter", "LOG_FORMATS", "configure"]

#: the context a log call may attach (``log.info(..., extra={"lock": name, "token": t})``)
CONTEXT_FIELDS = ("session", "client", "lock", "token", "correlation_id", "principal")
LOG_FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON (module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        out = {"time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for field in CONTEXT_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str, fmt: str, stream: TextIO) -> None:
    """Send the root logger's records at ``level`` (a name, any case) and above to
    ``stream``, as text or JSON (``fmt``: one of :data:`LOG_FORMATS`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
