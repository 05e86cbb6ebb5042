"""megatron_lc: Megatron-style pretraining for very long context."""
__version__ = "0.1.0"
