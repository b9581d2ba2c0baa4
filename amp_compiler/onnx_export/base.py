"""What every part of the export shares: its error and the targets and dtypes it takes."""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in the exporter's and ORT's messages
TARGETS = ("cuda", "cpu", "openvino")
EXPORT_DTYPES = ("bf16", "fp16", "fp32")


class ExportError(RuntimeError):
    """Export or its check failed; nothing was written."""
