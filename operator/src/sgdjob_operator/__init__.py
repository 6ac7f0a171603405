"""SGDJob operator: API models, CRD generation, policy core, Kubernetes and local shells."""

__version__ = "0.1.0"
