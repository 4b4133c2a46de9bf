"""Make tests/data's helper module (`data_helpers`) importable from its tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
