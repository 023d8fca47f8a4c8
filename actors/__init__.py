"""Workers that own a model and serve it: `RolloutWorker` (a vLLM engine) and `ReferenceWorker` (frozen policy).

Plain classes, usable and tested without Ray; `cluster/fleet/placement.py` makes them Ray actors in one place.
"""
