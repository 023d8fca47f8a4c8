"""The pure math of RL fine-tuning: advantage estimators, policy losses, KL estimators, log-probabilities.

Every module here imports only torch and the standard library and holds pure functions over tensors, looked up
by the config's names through a plain dict at the bottom of each module. It owns no model, optimiser, batch type
or device placement: running models over token rows is `learner.passes` (above this), training the rest of
`learner/`. Importable without transformers or any model.
"""
