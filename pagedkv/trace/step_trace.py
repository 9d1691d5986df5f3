"""`StepTrace`: records every step of an attached `LLM`; saves and loads them as JSON."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.trace.checks import check_trace_values
from pagedkv.trace.recorder import engine_info, step_record
from pagedkv.trace.records import EngineInfo, StepRecord

if TYPE_CHECKING:
    from pagedkv.engine.events import StepEvent
    from pagedkv.engine.llm import LLM

TRACE_FORMAT = "pagedkv-trace"
TRACE_VERSION = 1
NOT_STEP_TRACES = ("prefill_ladder_", "profile_step_")
"""Prefixes of the other JSON files beside the shipped step traces (notebooks 15 and 16 read them)."""


class StepTrace:
    """A list of `StepRecord`s plus the `EngineInfo` they refer to; fills itself while attached."""

    def __init__(self, engine: EngineInfo, steps: list[StepRecord] | None = None) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = steps if steps is not None else []
        self._observers: list[Callable[[StepRecord], None]] = []
        self._llm: LLM | None = None
        self._detach: Callable[[], None] | None = None
        self._last_model_time = 0.0

    # ---- recording -------------------------------------------------------------------

    @classmethod
    def attach(cls, llm: LLM) -> StepTrace:
        """A new trace that records every step `llm` runs until `detach()`."""
        trace = cls(engine_info(llm))
        trace._llm = llm
        trace._last_model_time = llm.stats.model_time_s
        trace._detach = llm.add_step_listener(trace._record)
        return trace

    def detach(self) -> None:
        """Stop recording (the steps so far stay)."""
        if self._detach is not None:
            self._detach()
        self._detach, self._llm = None, None

    @property
    def is_live(self) -> bool:
        return self._detach is not None

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def observe(self, callback: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call `callback(record)` after each newly recorded step (how live widgets update);
        returns a function that stops it (a widget's `close()` calls it)."""
        self._observers.append(callback)

        def stop() -> None:
            if callback in self._observers:
                self._observers.remove(callback)

        return stop

    def _record(self, event: StepEvent) -> None:
        assert self._llm is not None
        model_time = self._llm.stats.model_time_s
        record = step_record(event, self._llm, model_time - self._last_model_time)
        self._last_model_time = model_time
        self.append(record)

    def append(self, record: StepRecord) -> None:
        self.steps.append(record)
        for callback in list(self._observers):
            callback(record)

    # ---- reading -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> StepRecord:
        return self.steps[index]

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self.steps)

    def step_numbers(self) -> list[int]:
        return [r.step for r in self.steps]

    def req_ids(self) -> list[str]:
        """Every request seen in the trace (scheduled, preempted or finished in a recorded step),
        in order of first appearance. A trace attached mid-run can see a request only preempted."""
        seen: dict[str, None] = {}
        for record in self.steps:
            seen.update(dict.fromkeys(r.req_id for r in record.requests))
            seen.update(dict.fromkeys([*record.preempted_req_ids, *record.finished_req_ids]))
        return list(seen)

    def __repr__(self) -> str:
        state = "live" if self.is_live else "recorded"
        return (
            f"StepTrace({len(self.steps)} steps, {state}, model={self.engine.model!r}, "
            f"{self.engine.num_blocks} blocks x {self.engine.block_size} tokens, "
            f"{self.engine.num_kv_cache_groups} KV cache group(s))"
        )

    # ---- JSON --------------------------------------------------------------------------

    def to_json(self) -> str:
        payload = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "engine": dataclasses.asdict(self.engine),
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }
        return json.dumps(payload, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StepTrace:
        """The trace in `text` (what `to_json` wrote); its shape and values are checked
        (pagedkv/trace/checks.py), so a view never meets a block id outside the pool."""
        try:
            payload = json.loads(text)
        except RecursionError:  # json's parser recurses per level: thousands of [[[... exhaust Python's stack
            raise ValueError(
                "its JSON is nested too deeply to parse (a trace nests a few levels: engine, steps, requests)."
            ) from None
        if payload.get("format") != TRACE_FORMAT or payload.get("version") != TRACE_VERSION:
            raise ValueError(
                f"Not a {TRACE_FORMAT} v{TRACE_VERSION} file "
                f"(format={payload.get('format')!r}, version={payload.get('version')!r})."
            )
        engine = _from_plain(EngineInfo, payload["engine"])
        steps = [_from_plain(StepRecord, s) for s in payload["steps"]]
        check_trace_values(engine, steps)
        return cls(engine, steps)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load_shipped(cls, name: str) -> StepTrace:
        """A trace that ships with pagedkv, by name (`"h200_tiny-hybrid"`: the workbook's
        notebooks/traces/h200_tiny-hybrid.json), from an installed wheel or a clone alike."""
        from pagedkv.workbook import shipped_dirs  # the workbook knows where this installation keeps its files

        traces = shipped_dirs()[0] / "traces"
        path = traces / f"{name.removesuffix('.json')}.json"
        if not path.is_file():
            names = sorted(p.stem for p in traces.glob("*.json") if not p.stem.startswith(NOT_STEP_TRACES))
            raise ValueError(f"No shipped trace {name!r}; the shipped step traces are {names} (in {traces}).")
        return cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> StepTrace:
        """The trace saved in `path`; a file that is not one is a ValueError naming it."""
        path = Path(path)
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        # Bad JSON or UTF-8, bad values (ValueErrors), or JSON of another shape: a missing key, a list for a dict, ...
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{path} is not a readable {TRACE_FORMAT} v{TRACE_VERSION} file: {type(exc).__name__}: {exc}"
            ) from exc


def _from_plain(tp: Any, value: Any) -> Any:
    """Rebuild a (nested) dataclass from what `dataclasses.asdict` + JSON made of it.

    A field missing from an older trace takes its default (a field without one is required).
    """
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type, not an instance
        hints = typing.get_type_hints(tp)
        fields = [f.name for f in dataclasses.fields(tp) if f.name in value]
        return tp(**{name: _from_plain(hints[name], value[name]) for name in fields})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [_from_plain(args[0], v) for v in value]
    if origin is dict:
        return {k: _from_plain(args[1], v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType) and value is not None:
        return _from_plain(next(a for a in args if a is not type(None)), value)
    return value
