"""`python -m worker ...` is `pagedq worker ...`."""

import sys

from worker.cli import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
