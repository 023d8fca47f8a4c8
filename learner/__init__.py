"""The learner: the policy being trained, its optimiser step, the math it runs (`learner.algo`) and its passes over
token rows (`learner.passes`, which the reference, teacher and reward-model actors share).

Owns turning a batch of scored rollouts into a parameter update. Does not own sampling (`actors/`), scoring
(`rewards/`), moving weights (`sync/`) or placing anything on a cluster (`cluster/`).
"""
