"""What several test modules share: paths, models, model files and runs (no test module imports another)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
EXAMPLES = ROOT / "examples"
"""The bundled example model files and data recipes."""
