"""The planner's thresholds, each with why it is what it is."""
from __future__ import annotations

VERIFY_WITHIN = 0.75
"""Only candidates predicted at least this fraction of the best candidate's speed are worth timing."""
