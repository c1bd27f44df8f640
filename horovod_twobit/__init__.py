"""horovod-twobit: MXNet's 2-bit gradient compression, with error feedback, as a Horovod compressor."""

__version__ = "0.1.0"
