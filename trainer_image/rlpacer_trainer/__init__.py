"""rlpacer_trainer: the data plane (RL driver, rollout engines, learner, rewards, Ray glue)."""
