"""``python -m fsdp_autopatch.demo``: the demo's entry point, and how the parent starts each rank."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
