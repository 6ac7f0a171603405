"""The Kubernetes shell: kopf handlers, the reconcile pass and everything it builds and writes.

`kopf run -m sgdjob_operator.k8s` imports this package with kopf already loaded, and the handlers
register then. Other importers (the `sgdjob` CLI, unit tests of the pure builders) do not load kopf
and do not pay for it; `sgdjob operator` imports `sgdjob_operator.k8s.handlers` itself.
"""

import sys

if "kopf" in sys.modules:
    import sgdjob_operator.k8s.handlers  # noqa: F401
