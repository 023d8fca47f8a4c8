"""The pure math of RL fine-tuning: advantage estimators, policy losses, KL estimators, log-probabilities.

Every module here imports only torch and the standard library and holds pure functions over tensors, looked up
by the config's names through a plain dict at the bottom of each module. It owns no model, optimiser, batch type
or device placement; those live in `learner/` and above.
"""
