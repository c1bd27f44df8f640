"""``python -m horovod_twobit.advise``: the advisor's command line (:mod:`horovod_twobit.advisor.cli`)."""

import sys

from horovod_twobit.advisor.cli import main

if __name__ == "__main__":
    sys.exit(main())
