"""README's generated tables (supported models, ops) match what the code generates now."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "update_readme.py"


def test_readme_generated_tables_are_current():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
