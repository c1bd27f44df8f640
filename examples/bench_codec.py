"""Codec throughput vs memory bandwidth; see horovod_twobit/benchmarks/codec.py.

    python examples/bench_codec.py --sizes 1K,64K,1M,16M,64M
"""

from horovod_twobit.benchmarks.codec import main

if __name__ == "__main__":
    main()
