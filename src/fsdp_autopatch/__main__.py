"""``python -m fsdp_autopatch`` -> the CLI (same as the ``fsdp-autopatch`` console script)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
