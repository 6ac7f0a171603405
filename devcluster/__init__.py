"""A local Kubernetes cluster: the real control plane plus real kubelet nodes with containerd (README.md)."""
