"""A command for tests/test_forkserver.py to fork: it reports what it was given, then sleeps or exits as asked.

``python -m forkserver_probe CODE [SECONDS]`` prints one JSON line (its arguments, directory, an environment
variable, a number from numpy's global generator), writes ``probe`` to standard error, sleeps ``SECONDS``
(default none) and exits with ``CODE``.
"""

import json
import os
import sys
import time

import numpy

if __name__ == "__main__":
    code = int(sys.argv[1])
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "variable": os.environ.get("FORKSERVER_PROBE"),
                "random": int(numpy.random.randint(1 << 30)),
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    print("probe", file=sys.stderr, flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    sys.exit(code)
