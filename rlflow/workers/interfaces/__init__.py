"""Role interfaces: what each MFC computes for an actor, critic, reference, reward or teacher model.

:func:`build_interface` picks the class once from :attr:`ModelSetup.role` (and, for a reward,
whether it is rule-based); nothing downstream branches on the role again.
"""

from __future__ import annotations

from rlflow.workers.interfaces.actor import ActorInterface
from rlflow.workers.interfaces.base import ModelInterface
from rlflow.workers.interfaces.critic import CriticInterface
from rlflow.workers.interfaces.ref import RefInterface, TeacherInterface
from rlflow.workers.interfaces.reward import RewardModelInterface, RuleRewardInterface
from rlflow.workers.setup import ModelSetup, WorkerSetup

__all__ = [
    "INTERFACES",
    "ActorInterface",
    "CriticInterface",
    "ModelInterface",
    "RefInterface",
    "RewardModelInterface",
    "RuleRewardInterface",
    "TeacherInterface",
    "build_interface",
    "check_calls",
]

INTERFACES: dict[str, type[ModelInterface]] = {
    "actor": ActorInterface,
    "critic": CriticInterface,
    "ref": RefInterface,
    "reward": RewardModelInterface,
    "teacher": TeacherInterface,
}


def build_interface(model: ModelSetup, setup: WorkerSetup) -> ModelInterface:
    """The interface of ``model``: by role, with rule-based rewards served by :class:`RuleRewardInterface`."""
    cls = RuleRewardInterface if model.rule_based else INTERFACES[model.role]
    return cls(model, setup)


def check_calls(setup: WorkerSetup) -> None:
    """Raise ``ValueError`` for an MFC that its model's interface cannot serve.

    Run by every :class:`~rlflow.workers.model_worker.ModelWorker` at construction; the driver
    may call it first to fail before any worker starts.
    """
    for mfc in setup.mfcs.values():
        model = setup.models[mfc.model_name]
        (RuleRewardInterface if model.rule_based else INTERFACES[model.role]).check_mfc(mfc)
