"""``python -m hpcdist.cli``: the same as the ``hpcdist`` command."""

import sys

from hpcdist.cli import main

sys.exit(main())
