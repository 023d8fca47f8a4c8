"""The command line: `relay train | resume | submit | plot | scale | verifier serve`, Ray jobs and plots."""

from cluster.cli.commands import main

__all__ = ["main"]
