import sys
from pathlib import Path

# The model-parity helpers (transformers' greedy references and the engine-feature runs) live in tests/models.
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
