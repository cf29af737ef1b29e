"""patchgen tests: put the fake upstream package and the fixture configs on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
if str(FIXTURES) not in sys.path:
    # At import time, not in a fixture: test modules import `fakeup` at their top.
    sys.path.insert(0, str(FIXTURES))
