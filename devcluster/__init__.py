"""A local Kubernetes cluster whose pods are processes: the real control plane plus a node agent (README.md)."""
