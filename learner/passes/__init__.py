"""Running a model over token rows: the code the learner and the other model actors (reference, teacher, reward models)
share.

Owns the token layout and its wire form (`sequences`: `Rows`, `SequenceBatch`, padding), the passes over it
(`sequences`: micro-batches cut by a token budget, shared prompts, logprobs and entropies), packed passes
(`packing`) and the device and precision they run in (`device`). Does not own the math on the passes' outputs
(`learner.algo`, below this), nor training: optimisers, updates and checkpoints are the rest of `learner/`, which
`actors/` never imports; `actors/` and `learner/` both import this.
"""
