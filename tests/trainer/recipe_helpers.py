"""Overrides shared by the tests that run recipes: the GRPO recipe shrunk to a one-step run, a
few-step run on one worker, and the recipe turned into PPO."""

# One step of warm-up and of GRPO on a 2-layer, 64-wide model: seconds of compute.
TINY = [
    "trainer.total_steps=1",
    "warmup.steps=1",
    "warmup.batch_size=8",
    "data.batch_size=4",
    "data.eval_size=8",
    "algorithm.n_samples=2",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "placement.search_seconds=0.5",
    "placement.profile=false",  # the recipe's profile of this machine costs 12-15 s a run
    "logging.tensorboard=false",
]

# The main recipe turned into PPO with a rule-based reward: a critic (GAE) and a reference (KL in
# the reward), both copied from the actor when RL starts. The PPO recipe itself scores with a
# reward model trained by other recipes first; tests of the PPO dataflow do not need that.
PPO_FROM_GRPO = [
    "experiment_name=ppo_rule_reward",
    "algorithm.name=ppo",
    "algorithm.adv_estimator=gae",
    "algorithm.n_samples=1",
    "algorithm.lam=0.95",
    "algorithm.clip_ratio_high=0.2",
    "algorithm.kl_coef=0.02",
    "algorithm.kl_estimator=k1",
    "algorithm.kl_in_reward=true",
    "algorithm.n_minibatches=2",
    "models.ref.init=copy",
    "models.ref.init_from=actor",
    "models.critic.init=copy",
    "models.critic.init_from=actor",
    "models.critic.lr=1e-3",
]

# A few steps on one CPU worker with no warm-up, planning or profile: a 2-layer, 64-wide actor.
TINY_ACTOR = [
    f"models.actor.{o}"
    for o in ("hidden_size=64", "intermediate_size=128", "num_layers=2", "num_heads=4", "num_kv_heads=2", "lr=1e-3")
]
QUICK_FIT = [
    "trainer.eval_every=0",
    "warmup.steps=0",
    "data.batch_size=4",
    "data.eval_size=4",
    "placement.mode=heuristic",
    "placement.devices_per_node=1",
    "placement.profile=false",
    "logging.console=false",
    "logging.tensorboard=false",
]
