"""Tracing: spans and counters from every actor and data-plane worker on one timeline."""

from freetoken.trace.recorder import NULL_RECORDER, Span, TraceRecorder

__all__ = ["NULL_RECORDER", "Span", "TraceRecorder"]
