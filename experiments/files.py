"""Reading the jobs' results files (writing goes through :func:`latte_plugin.storage.atomic_write_json`)."""
from __future__ import annotations

import copy
import json
import os
from typing import Any


def read_json(path: str, missing: Any = None) -> Any:
    """The parsed file at ``path``, or a copy of ``missing`` where there is none yet (a job's first run)."""
    if not path or not os.path.isfile(path):
        return copy.deepcopy(missing)
    with open(path, encoding="utf-8") as f:
        return json.load(f)
