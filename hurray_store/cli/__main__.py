"""``python -m hurray_store.cli``."""

import sys

from hurray_store.cli import main

sys.exit(main())
