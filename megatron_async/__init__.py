"""megatron_async: asynchronous (PipeDream-2BW) pipeline pretraining for Megatron-Core."""

__version__ = "0.1.0"
