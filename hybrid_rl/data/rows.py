"""Reading rows of a prompt file: .jsonl or .parquet, one dict a row (the prompt datasets and GSM8K read them)."""

from __future__ import annotations

import json
import os

from hybrid_rl.runtime.errors import UserError


class DataError(UserError, ValueError):
    """A dataset that cannot be trained on as it is (a row, a file, a prompt); the message names the file and row."""


class DataFileMissing(UserError, FileNotFoundError):
    """A data file that is not there; the message names the config key."""


def read_rows(path: str, kind: str = "", key: str = "data.path") -> list[dict]:
    """Rows of a .jsonl or .parquet file (`kind`, else by its extension); `key` names the setting in errors."""
    if not os.path.isfile(path):
        raise DataFileMissing(f"{key} {path!r} does not exist")
    kind = kind or ("parquet" if path.endswith(".parquet") else "jsonl")
    rows = _read_parquet(path) if kind == "parquet" else _read_jsonl(path)
    if not rows:
        raise DataError(f"{key} {path!r} holds no rows")
    return rows


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
    return rows


def _read_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading the parquet file {path!r} needs pyarrow: pip install pyarrow (or convert it to .jsonl)"
        ) from None
    return pq.read_table(path).to_pylist()
