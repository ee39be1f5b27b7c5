import sys
from pathlib import Path

# Shared test helpers (coretools, helpers/) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
