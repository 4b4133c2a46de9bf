"""Shared test set-up: make tests/_support importable (as `_support`) from every test module and worker script."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
