"""The command line (`commands`: `relay train | submit | jobs | stop | scale | status | plot | build-demo-model |
verifier serve`), Ray jobs (`jobs`) and plots (`plot`)."""

from cluster.cli.commands import main

__all__ = ["main"]
