"""docs/models.md is generated from the registry: it must be regenerated whenever a family changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_models_doc_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "models_table.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
