import sys
from pathlib import Path

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))
