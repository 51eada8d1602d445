"""``python -m fedpart ...``: the ``fedpart`` command."""

import sys

from fedpart.cli.main import main

sys.exit(main())
