"""SGDJob trainer: torchrun-launched workers that switch between sync, hierarchical and async SGD."""

__version__ = "0.1.0"
