"""``python -m mirrorsd.cli``: what torchrun launches (``torchrun ... -m mirrorsd.cli generate``)."""

import sys

from mirrorsd.cli import main

sys.exit(main())
