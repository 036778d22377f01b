"""zerogap: a gRPC generation service with an overlapped batch scheduler."""

__version__ = "0.1.0"
