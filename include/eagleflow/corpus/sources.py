"""Read one configured source into an Arrow-backed ``datasets.Dataset``.

JSONL and JSON records are kept as their raw JSON text (column ``__raw``) so a
malformed line becomes a reported bad record, not a crash of the reader.
Parquet files and ``save_to_disk`` directories keep their own columns. Every
source gets ``__row`` (0-based record position: the ``row`` of the sample id
``source:row``) and ``__where`` (what an error report says: "line 7" or "row 3").
JSONL lines are decoded one by one: a line that is not valid UTF-8 keeps its
text with replacement characters in ``__raw`` and says why in
``__decode_error``, so it becomes a bad record naming its line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from eagleflow.config import SourceConfig


class SourceError(ValueError):
    """A source that cannot be read at all (missing file, unknown format)."""


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "arrow"
        raise SourceError(f"source directory {path} is not a `datasets` save_to_disk directory "
                          "(no state.json); point the source at a file or such a directory")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}.get(suffix.lower())
    if fmt is None:
        raise SourceError(f"source {path}: cannot tell the format from suffix {path.suffix!r}; "
                          "set format: jsonl | json | parquet | arrow in the source's config")
    return fmt


def _jsonl_lines(path: str, limit: int | None) -> Iterator[dict]:
    # Bytes, decoded line by line: invalid UTF-8 is that line's bad record, never U+FFFD counted good.
    row = 0
    with open(path, "rb") as f:
        for lineno, data in enumerate(f, start=1):
            if not data.strip():
                continue  # blank lines are not records
            if limit is not None and row >= limit:
                return
            try:
                line, problem = data.decode("utf-8"), None
            except UnicodeDecodeError as e:
                line = data.decode("utf-8", errors="replace")
                problem = (f"not valid UTF-8: byte {data[e.start:e.start + 1]!r} at byte {e.start + 1} of the line "
                           f"({e.reason}); re-encode the file as UTF-8")
            yield {"__row": row, "__where": f"line {lineno}", "__raw": line, "__decode_error": problem}
            row += 1


def _json_elements(path: str, limit: int | None) -> Iterator[dict]:
    # A JSON document must be parsed whole; a top-level list or {"data": [...]} is accepted.
    with open(path, "rb") as f:
        try:
            doc = json.loads(f.read().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SourceError(f"source {path}: not valid UTF-8 at byte {e.start} ({e.reason}); "
                              "re-encode the file as UTF-8") from None
        except json.JSONDecodeError as e:
            raise SourceError(f"source {path}: not valid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
                              "a .json source must hold one list of records (use .jsonl for one record a line)") from None
        except RecursionError:   # the document is parsed whole: one record nested thousands deep sinks the file
            raise SourceError(f"source {path}: nested too deeply to read (thousands of levels of arrays/objects); "
                              "no conversation is nested like that. Fix the record, or use .jsonl, where such a "
                              "line is one located bad record") from None
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise SourceError(f"source {path}: the top level is {type(doc).__name__}; expected a list of records")
    for row, rec in enumerate(doc):
        if limit is not None and row >= limit:
            return
        yield {"__row": row, "__where": f"row {row}", "__raw": json.dumps(rec), "__decode_error": None}


def load_source(src: SourceConfig, path: Path, cache_dir: str):
    """The source as a Dataset with ``__row``, ``__where`` and ``__raw`` or structured columns."""
    import datasets

    if not path.exists():
        raise SourceError(f"source {src.name!r}: {path} does not exist; fix corpus.sources[].path")
    fmt = detect_format(path, src.format)
    features = datasets.Features({"__row": datasets.Value("int64"), "__where": datasets.Value("string"),
                                  "__raw": datasets.Value("string"), "__decode_error": datasets.Value("string")})
    if fmt in ("jsonl", "json"):
        gen = _jsonl_lines if fmt == "jsonl" else _json_elements
        if next(gen(str(path), src.limit), None) is None:  # datasets cannot build from an empty generator
            return datasets.Dataset.from_dict({k: [] for k in features}, features=features)
        try:
            ds = datasets.Dataset.from_generator(gen, gen_kwargs={"path": str(path), "limit": src.limit},
                                                 features=features, cache_dir=cache_dir, keep_in_memory=False)
        except datasets.exceptions.DatasetGenerationError as e:
            cause = e.__cause__ or e
            if isinstance(cause, SourceError):
                raise cause from None
            raise
        return ds
    if fmt == "parquet":
        ds = datasets.Dataset.from_parquet(str(path), cache_dir=cache_dir, keep_in_memory=False)
    elif fmt == "arrow":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise SourceError(f"source {src.name!r}: {path} holds a DatasetDict with splits {list(ds)}; "
                              "save one split (ds['train'].save_to_disk(...)) and point the source at it")
    else:  # pragma: no cover - config validation restricts the values
        raise SourceError(f"source {src.name!r}: unknown format {fmt!r}")
    if src.limit is not None and src.limit < len(ds):
        ds = ds.select(range(src.limit))
    return ds.add_column("__row", list(range(len(ds))))  # "__where" is derived from it
