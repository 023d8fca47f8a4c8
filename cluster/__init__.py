"""The run: its configuration (`config`), the step loop (`run/`), the actors on Ray (`fleet/`), the command line
(`cli/`) and the built-in demo (`demo/`).

The top layer: it may import actors/, learner/, rewards/ and sync/; nothing imports it.
"""
