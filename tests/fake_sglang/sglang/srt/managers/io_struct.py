"""Reply records the Engine returns (`srt/managers/io_struct.py`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class LoRAUpdateOutput:
    """What load_lora_adapter_from_tensors / unload_lora_adapter return (a record, not a tuple)."""
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[Dict[str, str]] = None
