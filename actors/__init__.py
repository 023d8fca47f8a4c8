"""Workers that own a model and serve it: `RolloutWorker` (a vLLM engine) and `ReferenceWorker` (frozen policy).

Plain classes, usable and tested without Ray; `cluster.remote` turns them into Ray actors in one place.
"""
