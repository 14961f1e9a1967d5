"""``python -m hora.launch ARGS``: ``hora run ARGS`` without the ``hora`` script on PATH.

Data plane. The hora service starts an elastic job's driver this way, with its own Python.
"""

import sys

from hora.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
