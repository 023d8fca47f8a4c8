"""The learner: the policy being trained, its optimiser step, and the math it runs (in `learner.algo`).

Owns turning a batch of scored rollouts into a parameter update. Does not own sampling (`actors/`), scoring
(`rewards/`), moving weights (`sync/`) or placing anything on a cluster (`cluster/`).
"""
