"""ernie5: an open implementation of the ERNIE 5.0 recipe and its elastic evaluation harness."""

__version__ = "0.1.0"
