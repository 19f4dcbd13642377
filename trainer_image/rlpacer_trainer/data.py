"""Prompt data from files (``spec.data.source``): JSON Lines or Parquet, checked when the
trainer starts.

Each line of the file is one JSON object; ``spec.data.promptField`` and ``answerField`` name
the prompt text and the reference answer (dots reach into nested objects: ``meta.question``).
A held-out set comes from ``spec.data.evalSource`` (a second file, same fields) or
``spec.data.evalFraction`` of the source (drawn with ``spec.data.seed``).

Everything is read and checked before anything heavy starts; the first bad record fails the
run with :class:`DataError`, naming the spec field, the file, the line and the record field.
The pod entrypoint exits with :data:`rlpacer.api.contract.EXIT_DATA_INVALID` on it, and the
operator fails the job with reason ``DataInvalid`` (no retries: the same data fails the same
way).

A source whose name ends in ``.parquet`` is a Parquet file instead (read with ``pyarrow``, a
row group at a time): each row is one record, struct columns are nested objects (the same
dotted names reach into them), and errors name the row (1-based) where JSON Lines name the
line.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlpacer.api import sources


class DataError(ValueError):
    """Bad data: the message names the spec field, the file, the line and the record field."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt of a file: its index in the set, text, reference answer, file:line."""

    pid: int
    prompt: str
    answer: str
    where: str

    @property
    def reference(self) -> str:
        """What an exact-match reward compares the response with: the answer."""
        return self.answer


def get_field(record: dict[str, Any], dotted: str) -> Any:
    """``record['a']['b']`` for ``a.b``; KeyError naming the missing part."""
    cur: Any = record
    done: list[str] = []
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            have = sorted(cur) if isinstance(cur, dict) else type(cur).__name__
            raise KeyError(f"{'.'.join([*done, part])} (found: {have})")
        cur = cur[part]
        done.append(part)
    return cur


def read_jsonl(path: Path, prompt_field: str, answer_field: str, *, spec_field: str,
               start: int = 0) -> list[Example]:
    """The file's examples (JSON Lines, or Parquet for a ``.parquet`` name), checked;
    :class:`DataError` at the first bad record."""
    at = f"{spec_field}: {path}"
    if not path.is_file():
        raise DataError(f"{at}: no such file (a pvc:// source is mounted read-only at"
                        f" {sources.claim_mount('<claim>')}/; check the claim and the path)")
    parquet = path.suffix == ".parquet"
    unit = "row" if parquet else "line"
    out: list[Example] = []
    for n, rec in (_parquet_rows(path, at) if parquet else _jsonl_records(path, at)):
        vals = []
        for name, field in (("promptField", prompt_field), ("answerField", answer_field)):
            try:
                v = get_field(rec, field)
            except KeyError as e:
                raise DataError(
                    f"{at} {unit} {n}: field {field!r} (spec.data.{name}) missing:"
                    f" no {e.args[0]}; fix the record or set spec.data.{name}") from e
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                kind = "null" if v is None else type(v).__name__
                raise DataError(
                    f"{at} {unit} {n}: field {field!r} (spec.data.{name}) is a {kind};"
                    " expected text (or a number for the answer)")
            if name == "promptField" and not isinstance(v, str):
                raise DataError(f"{at} {unit} {n}: field {field!r} (spec.data.{name})"
                                f" is a {type(v).__name__}; the prompt must be text")
            if not str(v).strip():
                raise DataError(f"{at} {unit} {n}: field {field!r} (spec.data.{name})"
                                " is empty")
            vals.append(str(v))
        out.append(Example(start + len(out), vals[0], vals[1], f"{path}:{n}"))
    if not out:
        what = "no rows" if parquet else "no records (an empty file); give one JSON object per line"
        raise DataError(f"{at}: {what}")
    return out


def _jsonl_records(path: Path, at: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{at} line {n}: not valid JSON ({e.msg} at column"
                                    f" {e.colno}); each line must be one JSON object") from e
                if not isinstance(rec, dict):
                    raise DataError(f"{at} line {n}: a JSON {type(rec).__name__}, expected"
                                    " an object with the prompt and answer fields")
                yield n, rec
        except UnicodeDecodeError as e:
            raise DataError(f"{at}: not UTF-8 text ({e.reason} at byte {e.start} of a"
                            " line); JSON Lines files are UTF-8") from e


def _parquet_rows(path: Path, at: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # an image built without the trainer extra
        raise DataError(f"{at}: reading Parquet needs pyarrow, which this trainer image lacks;"
                        " use the project's trainer image or convert the file to JSON"
                        " Lines") from e
    try:
        pf = pq.ParquetFile(path)
        n = 0
        for batch in pf.iter_batches(batch_size=4096):
            for rec in batch.to_pylist():
                n += 1
                yield n, rec
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{at}: not a readable Parquet file ({e}); give a Parquet file or"
                        " JSON Lines (a name not ending in .parquet)") from e


def file_path(source: str, spec_field: str) -> Path:
    local = sources.local_path(source, spec_field)
    assert local is not None, "builtin sources have no file"
    return Path(local)


def load(spec: Any) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples of ``spec.data`` (a file source); held-out may be []."""
    d = spec
    try:
        train = read_jsonl(file_path(d.source, "spec.data.source"), d.prompt_field,
                           d.answer_field, spec_field="spec.data.source")
        held: list[Example] = []
        if d.eval_source is not None:
            held = read_jsonl(file_path(d.eval_source, "spec.data.evalSource"), d.prompt_field,
                              d.answer_field, spec_field="spec.data.evalSource")
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise DataError(str(e)) from e
    if d.eval_fraction is not None:
        from rlpacer.api._base import decimal

        k = max(1, round(len(train) * decimal(d.eval_fraction)))
        if k >= len(train):
            raise DataError(f"spec.data.evalFraction: {d.eval_fraction} of {len(train)}"
                            " records leaves none to train on; lower it or add data")
        order = list(range(len(train)))
        random.Random(int(d.seed)).shuffle(order)
        out = set(order[:k])
        held = [train[i] for i in sorted(out)]
        train = [train[i] for i in range(len(train)) if i not in out]
    # pids: positions in their own list (the driver indexes problems by pid)
    train = [dataclasses.replace(e, pid=i) for i, e in enumerate(train)]
    held = [dataclasses.replace(e, pid=i) for i, e in enumerate(held)]
    return train, held
