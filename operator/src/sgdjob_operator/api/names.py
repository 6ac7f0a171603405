"""What an SGDJob may be called: the API server's rule for the object, plus what the operator
derives from the name (a headless Service called after the job, worker pods whose hostname is
`<job>-worker-<index>`), so `sgdjob validate` and `sgdjob run` refuse what `kubectl apply` or the
operator would.
"""

from __future__ import annotations

import re

from sgdjob_operator.api.job_status import MAX_WORKERS

# The API server: a custom object's name is a DNS-1123 subdomain.
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SUBDOMAIN_MAX = 253
# The Service that carries the job's name must be a DNS-1035 label (starts with a letter, no dots).
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_MAX = 63
# A worker pod's hostname `<job>-worker-<index>` is a DNS label too; indices stay below MAX_WORKERS.
NAME_MAX = LABEL_MAX - len("-worker-") - len(str(MAX_WORKERS - 1))


def name_problem(name: object) -> str | None:
    """Why `name` cannot name an SGDJob, with the fix; None when it can."""
    if name is None or name == "":
        return "missing: give the job a name (metadata.name: my-job), as kubectl apply requires"
    if not isinstance(name, str):
        return f"must be a string, not {type(name).__name__}"
    if len(name) > SUBDOMAIN_MAX or not DNS1123_SUBDOMAIN.match(name):
        return (
            f"'{name}' is not a DNS-1123 name, which the API server requires: use lowercase letters, digits "
            "and '-', starting and ending with a letter or digit"
        )
    if not DNS1035_LABEL.match(name):
        return (
            f"'{name}' cannot name the job's Service (a DNS-1035 label): start with a letter and leave out '.' "
            "(e.g. '" + _suggest(name) + "')"
        )
    if len(name) > NAME_MAX:
        return (
            f"'{name}' is {len(name)} characters; at most {NAME_MAX}, so that its worker pods' hostnames "
            f"('{name[:8]}...-worker-{MAX_WORKERS - 1}') stay within {LABEL_MAX}"
        )
    return None


def _suggest(name: str) -> str:
    fixed = re.sub(r"[^-a-z0-9]", "-", name).strip("-")
    return fixed if fixed[:1].isalpha() else f"job-{fixed}"
