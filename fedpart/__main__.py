"""``python -m fedpart ...``: the ``fedpart`` command."""

import sys

from fedpart.deploy.cli import main

sys.exit(main())
