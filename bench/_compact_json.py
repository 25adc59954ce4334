"""The gateway benchmarks' JSON results, written so that per-request tables stay readable."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """``data`` as indented JSON, except that a list of scalars (a table row) stays on one line: per-request
    tables stay readable and an order of magnitude smaller than with one value per line."""
    rows: list[str] = []
    nonce = uuid.uuid4().hex  # placeholders no real string can collide with

    def pack(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: pack(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            if v and all(_scalar(x) for x in v):
                rows.append(json.dumps(list(v), default=str))
                return f"\x00{nonce}:{len(rows) - 1}\x00"
            return [pack(x) for x in v]
        return v

    pattern = re.compile(rf'"\\u0000{nonce}:(\d+)\\u0000"')
    text = pattern.sub(lambda m: rows[int(m.group(1))], json.dumps(pack(data), indent=2, default=str))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return path
