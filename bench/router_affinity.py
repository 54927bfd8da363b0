"""Router session affinity on vs off with real worker processes (`make bench`): a thin entry point.

    python bench/router_affinity.py --model .models/tiny [--sessions 12 --turns 5] [--json OUT]

The logic lives in ``pdserve/app/loadgen/affinity.py`` (also ``python -m pdserve.app.loadgen.affinity``), so
the integration test can run a small version of the same code.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.app.loadgen.affinity import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
