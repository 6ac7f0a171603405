"""SGDJob: API models, policy core, and the shells that run it (Kubernetes, local, simulator).

Importing this package or any subpackage but `sgdjob_operator.k8s` registers no kopf handlers.
"""

__version__ = "0.1.0"
