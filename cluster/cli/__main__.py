"""`python -m cluster.cli`: the `relay` command line (cluster/cli/commands.py)."""

from cluster.cli import main

raise SystemExit(main())
