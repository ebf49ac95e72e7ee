"""How every benchmark ends: print its table, write its JSON where asked, return it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def emit(result: dict, table: str, json_path: Optional[str]) -> dict:
    print(table)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result
