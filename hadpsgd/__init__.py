"""hadpsgd: hierarchical decentralized training (SSGD, ADPSGD / H-ADPSGD, BMUF-Adam) for PyTorch."""

__version__ = "0.1.0"
