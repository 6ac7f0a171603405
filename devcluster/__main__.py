"""`python -m devcluster up|down|status`: the local cluster's command (devcluster/cluster.py)."""

import sys

from devcluster.cluster import main

sys.exit(main())
