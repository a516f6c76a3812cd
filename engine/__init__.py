"""The embedded speculative-decoding engine (vLLM in-process) and its telemetry.

Data path: requests -> ``SpecEngine`` (AsyncLLM + ``SpectuneScheduler``) ->
``RequestRecord``/``StepRecord`` -> ``RecordSink``s.  Control comes back in as
``RuntimeSettings`` through ``SpecEngine.apply``.  Nothing here knows about
databases or the tuner.
"""

from .classifier import PromptClassifier
from .config import EngineConfig
from .schema import BatchRange, ClassSettings, RequestRecord, RuntimeSettings, StepRecord
from .sinks import JsonlSink, MemorySink, RecordSink

__all__ = [
    "BatchRange",
    "ClassSettings",
    "EngineConfig",
    "JsonlSink",
    "MemorySink",
    "PromptClassifier",
    "RecordSink",
    "RequestRecord",
    "RuntimeSettings",
    "StepRecord",
]
