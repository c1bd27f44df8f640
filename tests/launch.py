"""``horovodrun`` for the tests: Horovod's own launcher, with its build checks answered once per
test session instead of once per job.

Before every launch Horovod's launcher forks a process that imports ``horovod.tensorflow`` (all of
TensorFlow: about 4 s of CPU on this project's machines) only to learn whether Horovod was built
with Gloo and with MPI. Those answers cannot change during a test session, so ``tests/jobs.py``
asks Horovod's own functions once and hands the answers over in ``HOROVOD_TWOBIT_TEST_BUILT``
(e.g. ``gloo,mpi``); everything else is ``horovod.runner.launch`` unchanged.
"""

import os
import sys

from horovod.runner import launch

if __name__ == "__main__":  # not again in the processes Horovod's launcher spawns
    built = set(os.environ["HOROVOD_TWOBIT_TEST_BUILT"].split(","))
    launch.gloo_built = lambda verbose=False: "gloo" in built
    launch.mpi_built = lambda verbose=False: "mpi" in built
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
