"""``python -m horovod_twobit.cluster``: see cli.py."""

import sys

from horovod_twobit.cluster.cli import _main

if __name__ == "__main__":
    sys.exit(_main())
