"""The actors of a run on Ray: placement (`placement`), the rollout fleet (`rollout_pool`), the learner's ranks
(`learner_group`) and the run registry that takes scaling requests (`control`)."""
