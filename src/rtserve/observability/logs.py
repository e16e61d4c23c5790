"""Logging: text or JSON lines, and the optional access log (one line per request)."""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import orjson

from rtserve.errors import InvalidInput
from rtserve.protocol.types import Timings

ACCESS = logging.getLogger("rtserve.access")
MAX_REQUEST_ID = 128
_REQUEST_ID = re.compile(f"[!-~]{{1,{MAX_REQUEST_ID}}}")
_UNSAFE = re.compile(r"[^!-~]")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, exception, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


def configure_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def checked_request_id(value: str) -> str:
    """A client's ``x-request-id`` if it is 1-128 visible ASCII characters (no spaces or
    control characters that could forge log lines or fields); otherwise ``InvalidInput``."""
    if _REQUEST_ID.fullmatch(value) is None:
        raise InvalidInput(
            f"x-request-id: expected 1-{MAX_REQUEST_ID} visible ASCII characters (no spaces "
            f"or control characters), got {len(value)} characters"
        )
    return value


def _field(value: object) -> str:
    """A value as one space-free token of a text log line (unsafe characters escaped)."""
    text = str(value)
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def access_line(
    t: Timings,
    model: str,
    version: str,
    status: int,
    rows: int,
    end_ns: int,
    trace_id: str,
) -> None:
    """Log one finished request (fields as ``extra`` so JSON logs carry them as keys)."""
    queue_us = (t.batch_start - t.enqueued) // 1000 if t.batch_start else 0
    compute_us = (t.batch_end - t.batch_start) // 1000 if t.batch_start else 0
    total_us = (end_ns - t.received) // 1000
    fields = {
        "model": model,
        "version": version,
        "status": status,
        "rows": rows,
        "queue_us": queue_us,
        "compute_us": compute_us,
        "total_us": total_us,
        "cache": t.cache or "-",
        "trace_id": trace_id or "-",
        "request_id": t.request_id or "-",
    }
    if t.prompt_tokens or t.completion_tokens:  # a generation
        fields["prompt_tokens"] = t.prompt_tokens
        fields["completion_tokens"] = t.completion_tokens
    ACCESS.info(" ".join(f"{k}={_field(v)}" for k, v in fields.items()), extra=fields)
