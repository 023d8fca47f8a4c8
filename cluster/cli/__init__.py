"""The command line (`commands`: `relay train | submit | jobs | stop | scale | status | plot | build-demo-model |
verifier serve`), Ray jobs (`jobs`) and plots (`plot`)."""

from __future__ import annotations

from cluster.cli.bytecode import keep_bytecode


def main(argv: list[str] | None = None) -> int:
    """`relay`: bytecode kept between runs (`keep_bytecode`), before the commands' own imports."""
    keep_bytecode()
    from cluster.cli.commands import main as run

    return run(argv)


__all__ = ["main"]
