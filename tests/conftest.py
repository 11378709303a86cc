import sys
from pathlib import Path

# Tests import their helpers (launch.py) and the project from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
