"""The provider interface, as the providers of this package implement it.

The types live in the kernel (:mod:`crush_trio.core.model`), so that the plain-logic cores and
the agent use them without importing the providers' HTTP stack; they are re-exported here for the
providers and their callers.
"""

from __future__ import annotations

from ..core.model import (
    Finished,
    ModelInfo,
    ModelRequest,
    Provider,
    ReasoningDelta,
    ReasoningDone,
    RequestPurpose,
    Retrying,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolSpec,
    Usage,
)

__all__ = [
    "Finished",
    "ModelInfo",
    "ModelRequest",
    "Provider",
    "ReasoningDelta",
    "ReasoningDone",
    "RequestPurpose",
    "Retrying",
    "StreamEvent",
    "TextDelta",
    "ToolCallDelta",
    "ToolCallDone",
    "ToolCallStart",
    "ToolSpec",
    "Usage",
]
