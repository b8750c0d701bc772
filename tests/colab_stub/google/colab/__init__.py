"""A stand-in for Colab's `google.colab` package, for tests: only `drive` (see drive.py).

Put tests/colab_stub on PYTHONPATH and `import google.colab` at kernel start to make a kernel
look like Colab's (nblib.env.runtime() == "colab"). `google` stays a namespace package, so
`google.protobuf` (TensorFlow's) still imports from site-packages.
"""
from . import drive

__all__ = ["drive"]
