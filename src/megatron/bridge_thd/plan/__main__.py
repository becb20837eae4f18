"""``python -m megatron.bridge_thd.plan``."""

import sys

from megatron.bridge_thd.plan.cli import main

sys.exit(main())
