"""Routing traces: which experts each token chose, at every MoE layer, recorded and replayed.

File format: JSON lines, one object per (request, step, layer):

    {"request": "r1", "step": 0, "layer": 3, "phase": "prefill",
     "experts": [[5, 17, ...], ...],    # one row of top-k expert ids per token
     "weights": [[0.31, 0.22, ...], ...]} # the router weights of those ids, same shape

`RoutingRecorder` writes such a file (thread-safe, buffered), `RoutingTrace.load` reads and
validates one (errors name the line), and `RoutingReplay` feeds a trace's choices to a model
in place of its router's top-k, so a real routing pattern can drive a model of another shape.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import msgspec

from freetoken.errors import FreetokenError

PHASES = ("prefill", "decode")
_FLUSH_LINES = 256


class TraceError(FreetokenError, ValueError):
    """A routing trace is malformed, or cannot be mapped onto the requested model shape."""


class RoutingRecord(msgspec.Struct, frozen=True):
    """One (request, step, layer): the top-k expert ids and router weights of each token."""

    request: str
    step: int
    layer: int
    phase: str
    experts: list[list[int]]
    weights: list[list[float]]

    @property
    def num_tokens(self) -> int:
        return len(self.experts)


def _check(rec: RoutingRecord) -> None:
    """Raise ValueError naming the first inconsistency of `rec`."""
    if rec.phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {rec.phase!r}")
    if rec.step < 0:
        raise ValueError(f"step must be >= 0, got {rec.step}")
    if rec.layer < 0:
        raise ValueError(f"layer must be >= 0, got {rec.layer}")
    if len(rec.weights) != len(rec.experts):
        raise ValueError(f"{len(rec.experts)} expert rows but {len(rec.weights)} weight rows")
    for i, (ids, ws) in enumerate(zip(rec.experts, rec.weights, strict=True)):
        if not ids:
            raise ValueError(f"token {i}: no experts")
        if len(ws) != len(ids):
            raise ValueError(f"token {i}: {len(ids)} experts but {len(ws)} weights")
        if min(ids) < 0:
            raise ValueError(f"token {i}: negative expert id in {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"token {i}: repeated expert id in {ids}")


class RoutingRecorder:
    """Appends routing records to a JSON-lines file.

    `record` may be called from any thread; lines are buffered and written in batches (and on
    `flush`/`close`). Use as a context manager or call `close()`.
    """

    def __init__(self, path: str | Path, flush_lines: int = _FLUSH_LINES) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._buf: list[bytes] = []
        self._flush_lines = max(1, flush_lines)
        self._file: IO[bytes] | None = open(self.path, "wb")
        self._encoder = msgspec.json.Encoder()

    def record(
        self,
        request: str,
        step: int,
        layer: int,
        phase: str,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
    ) -> None:
        """Add one record. Ids and weights may be any int/float-like (numpy scalars included)."""
        rec = RoutingRecord(
            request=str(request),
            step=int(step),
            layer=int(layer),
            phase=str(phase),
            experts=[[int(e) for e in row] for row in experts],
            weights=[[float(w) for w in row] for row in weights],
        )
        try:
            _check(rec)
        except ValueError as exc:
            raise TraceError(
                f"bad routing record (request {request!r}, step {step}, layer {layer}): {exc}"
            ) from None
        line = self._encoder.encode(rec) + b"\n"
        with self._lock:
            if self._file is None:
                raise TraceError(f"routing recorder for {self.path} is closed")
            self._buf.append(line)
            if len(self._buf) >= self._flush_lines:
                self._write_locked()

    def _write_locked(self) -> None:
        if self._buf and self._file is not None:
            self._file.write(b"".join(self._buf))
            self._buf.clear()

    def flush(self) -> None:
        with self._lock:
            self._write_locked()
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Write what is buffered and close the file; calling it again does nothing."""
        with self._lock:
            if self._file is None:
                return
            self._write_locked()
            self._file.close()
            self._file = None

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class RoutingTrace:
    """The records of a routing trace, in file order."""

    def __init__(self, records: Iterable[RoutingRecord]) -> None:
        self.records: list[RoutingRecord] = list(records)

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read and validate a JSON-lines trace; a bad line raises TraceError naming its number."""
        path = Path(path)
        decoder = msgspec.json.Decoder(RoutingRecord)
        records = []
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise TraceError(f"cannot read routing trace {path}: {exc.strerror or exc}") from None
        with fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rec = decoder.decode(line)
                    _check(rec)
                except (msgspec.DecodeError, ValueError) as exc:
                    raise TraceError(f"{path}, line {lineno}: {exc}") from None
                records.append(rec)
        return cls(records)

    def __iter__(self) -> Iterator[RoutingRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_layers(self) -> int:
        """Highest layer index seen + 1 (0 for an empty trace)."""
        return max((r.layer for r in self.records), default=-1) + 1

    @property
    def num_experts(self) -> int:
        """Highest expert id seen + 1 (a lower bound on the traced model's expert count)."""
        return max((max(row) for r in self.records for row in r.experts), default=-1) + 1

    @property
    def top_k(self) -> int:
        """Widest token row seen."""
        return max((len(row) for r in self.records for row in r.experts), default=0)

    def tokens_by_layer(self) -> dict[int, list[list[int]]]:
        """Every token row of each layer, in file order (records of all requests and phases)."""
        out: dict[int, list[list[int]]] = {}
        for rec in self.records:
            out.setdefault(rec.layer, []).extend(rec.experts)
        return out


def _mix(x: int) -> int:
    """A 64-bit integer hash (splitmix64 finaliser): fixed, platform independent."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def hash_permutation(n: int, seed: int) -> list[int]:
    """A fixed permutation of range(n): sort by a hash of (seed, index)."""
    return sorted(range(n), key=lambda i: (_mix(_mix(seed) ^ i), i))


class RoutingReplay:
    """Replays a trace's expert choices on a model of possibly different shape.

    Each model layer has its own cursor over the token rows of its trace layer (all records'
    tokens in file order, prefill and decode alike); `ids_for` returns the next rows and moves
    the cursor, wrapping around at the end of the trace.

    Mapping rules (all deterministic):
    - layers: model layer `l` replays trace layer `l * trace_layers // num_layers`; if that
      layer has no records (traces that saved only some layers), the nearest traced layer is
      used (the lower one on a tie).
    - experts, with T = the trace's expert count and E = the model's:
      T == E: identity. T > E: `e % E` (distinct trace ids may then collide; duplicates are
      dropped and the row padded as below). T < E: a fixed hash permutation of the model's E
      experts, per model layer, `perm[e]`: injective, so the trace's skew and reuse are kept,
      and only T of the E experts are ever used.
    - top-k: rows wider than the model's top_k keep their first top_k ids (the router's
      highest-weighted first); narrower rows are padded with distinct extra experts drawn
      from a hash of (layer, token position). Every returned row has top_k distinct ids in
      [0, E).
    """

    def __init__(
        self,
        trace: RoutingTrace | str | Path,
        num_layers: int,
        num_experts: int,
        trace_experts: int | None = None,
    ) -> None:
        if not isinstance(trace, RoutingTrace):
            trace = RoutingTrace.load(trace)
        if num_layers <= 0 or num_experts <= 0:
            raise TraceError(f"num_layers and num_experts must be positive, got {num_layers}, {num_experts}")
        by_layer = trace.tokens_by_layer()
        if not by_layer:
            raise TraceError("routing trace has no records to replay")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.trace_layers = trace.num_layers
        self.trace_experts = trace_experts if trace_experts is not None else trace.num_experts
        if self.trace_experts < trace.num_experts:
            raise TraceError(
                f"trace_experts={self.trace_experts} but the trace uses expert id {trace.num_experts - 1}"
            )
        traced = sorted(by_layer)
        self.layer_map: list[int] = []
        for layer in range(num_layers):
            want = layer * self.trace_layers // num_layers
            self.layer_map.append(min(traced, key=lambda t, w=want: (abs(t - w), t)))
        self._rows = by_layer
        self._cursor = [0] * num_layers
        self._perms: list[list[int]] | None = None
        if self.trace_experts < num_experts:
            self._perms = [hash_permutation(num_experts, 0x5EED + layer) for layer in range(num_layers)]
        self._lock = threading.Lock()
        self._tables: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # (layer, top_k) -> _mapped_rows

    def map_expert(self, layer: int, trace_expert: int) -> int:
        if self._perms is not None:
            return self._perms[layer][trace_expert]
        return trace_expert % self.num_experts

    def reset(self) -> None:
        with self._lock:
            self._cursor = [0] * self.num_layers

    def ids_for(self, layer: int, num_tokens: int, top_k: int) -> list[list[int]]:
        """The next `num_tokens` rows of `top_k` distinct expert ids for model layer `layer`."""
        if not 0 <= layer < self.num_layers:
            raise TraceError(f"layer {layer} out of range for a {self.num_layers}-layer replay")
        if not 0 < top_k <= self.num_experts:
            raise TraceError(f"top_k must be in 1..{self.num_experts}, got {top_k}")
        rows = self._mapped_rows(layer, top_k)
        with self._lock:
            start = self._cursor[layer]
            self._cursor[layer] = start + num_tokens
        out = []
        for pos in range(start, start + num_tokens):
            row = list(rows[pos % len(rows)])
            if len(row) < top_k:
                seen = set(row)
                c = _mix((layer << 40) ^ pos) % self.num_experts
                while len(row) < top_k:
                    if c not in seen:
                        seen.add(c)
                        row.append(c)
                    c = (c + 1) % self.num_experts
            out.append(row)
        return out

    def _mapped_rows(self, layer: int, top_k: int) -> list[tuple[int, ...]]:
        """Every trace row of `layer`'s trace layer as its first top_k distinct model experts
        (fewer where it has fewer; `ids_for` pads those per position). Mapped once per layer: a
        graph step draws every layer's rows on the host before it runs."""
        table = self._tables.get((layer, top_k))
        if table is None:
            table = []
            for trace_row in self._rows[self.layer_map[layer]]:
                mapped: list[int] = []
                for e in trace_row:
                    m = self.map_expert(layer, e)
                    if m not in mapped:
                        mapped.append(m)
                        if len(mapped) == top_k:
                            break
                table.append(tuple(mapped))
            self._tables[(layer, top_k)] = table
        return table
