"""dilocox: Megatron-style pre-training across decentralized clusters (DiLoCoX and friends)."""

__version__ = "0.1.0"
