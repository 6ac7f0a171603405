"""Local Kubernetes control plane, node agent and end-to-end scenarios for SGDJob."""
