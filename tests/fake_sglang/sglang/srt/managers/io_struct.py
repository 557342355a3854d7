"""Reply records the Engine returns (`srt/managers/io_struct.py`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""
