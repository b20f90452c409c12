"""A module for tests/test_forkserver.py to preload: its import takes ``FORKSERVER_SLOW_IMPORT`` seconds (default 1),
as torch's may on a cold, busy node."""

import os
import time

time.sleep(float(os.environ.get("FORKSERVER_SLOW_IMPORT", "1")))
