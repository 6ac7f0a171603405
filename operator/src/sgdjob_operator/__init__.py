"""SGDJob operator: API models, CRD generation, policy core, Kubernetes and local shells."""

import sys

__version__ = "0.1.0"

# `kopf run -m sgdjob_operator` imports this package with kopf already loaded: register the handlers
# then. The `sgdjob` CLI (validate, crd, run) does not load kopf and does not pay for it.
if "kopf" in sys.modules:
    import sgdjob_operator.handlers  # noqa: F401
