"""The reallocation manager driven through Ray actors, as the trainer drives it.

Four colocated CPU workers (one Ray actor each) hold an ``actor`` model trained with FSDP2 x TP
(home layout dp=2 x tp=2 on ranks 0-3) and a frozen ``ref`` model resting offloaded on ranks
0-1 (tp=2). The driver calls ``pre_call`` / ``post_call`` on the views the protocol names and
checks the assembled copies against the home weights.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from rlflow.controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker, register
from rlflow.parallel.groups import build_plan_groups
from rlflow.parallel.layout import build_layout
from rlflow.parallel.realloc import ReallocManager
from rlflow.strategy import ParallelStrategy

# Ray workers cannot import test modules: this one is shipped by value, and the helpers are
# imported inside the workers from the test directory (same machine).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
HELPERS_DIR = str(Path(__file__).parent)


def helpers():
    if HELPERS_DIR not in sys.path:
        sys.path.insert(0, HELPERS_DIR)
    return importlib.import_module("realloc_helpers")


HOSTS = {0: 0, 1: 0, 2: 1, 3: 1}
INPUT_IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))


def layouts(config) -> dict[str, object]:
    return {
        "actor_home": build_layout(config, ParallelStrategy(dp=2, tp=2), range(4), fsdp=True),
        "gen": build_layout(config, ParallelStrategy(tp=2), [2, 3]),
        "infer": build_layout(config, ParallelStrategy(dp=2, pp=2), range(4)),
        "ref_home": build_layout(config, ParallelStrategy(tp=2), [0, 1]),
    }


class ReallocWorker(Worker):
    """Hosts the manager; every method body is what a real role worker would run."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.config = helpers().tiny_qwen2_tied()
        self.layouts = layouts(self.config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup(self, keep_copies: bool) -> None:
        """Start-up on every pool rank: groups of all layouts, home modules, registration."""
        build_plan_groups([(lay.ranks, lay.strategy) for lay in self.layouts.values()], device_type="cpu")
        cfg, rank = self.config, self.rank
        self.manager = ReallocManager(rank, host_of=HOSTS)

        def factory(layout):
            return helpers().build_sharded_module(cfg, layout, rank, seed=None)

        actor = helpers().build_sharded_module(cfg, self.layouts["actor_home"], rank, seed=0)
        self.optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
        self.manager.register(
            "actor", self.layouts["actor_home"], actor, factory, dtype=torch.float32, keep_copies=keep_copies
        )
        ref = helpers().build_sharded_module(cfg, self.layouts["ref_home"], rank, seed=1)
        self.manager.register(
            "ref", self.layouts["ref_home"], ref, factory, dtype=torch.float32, trainable=False, offload_home=True
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pre_call(self, model: str, layout: str) -> dict:
        """Returns this rank's slices of the copy (for the driver to assemble) and counters."""
        module = self.manager.pre_call(model, self.layouts[layout])
        out = {"rank": self.rank, "reshards": self.manager.stats["reshards"], "module_id": id(module), "slices": {}}
        if module is not None:
            from rlflow.parallel.executor import module_param_tensors

            boxes = self.layouts[layout].slices(self.rank)
            out["slices"] = {n: (boxes[n], ts[0].clone()) for n, ts in module_param_tensors(module).items()}
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def post_call(self, model: str, layout: str) -> None:
        self.manager.post_call(model, self.layouts[layout])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self) -> None:
        actor = self.manager.home_module("actor")
        position_ids = torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS)
        actor(INPUT_IDS, position_ids=position_ids).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.manager.bump_version("actor")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def home_state(self, model: str) -> dict[str, torch.Tensor]:
        """Full home weights gathered by DTensor itself (collective over the home ranks)."""
        module = self.manager.pre_call(model, self.layouts[f"{model}_home"])
        state = {}
        for name, p in module.named_parameters():
            name = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            state[name] = p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
        self.manager.post_call(model, self.layouts[f"{model}_home"])
        return state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ema(self, eta: float) -> None:
        self.manager.ema_update("ref", "actor", eta)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ref_is_offloaded(self) -> bool:
        return self.manager._models["ref"].offloaded.offloaded


def assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from the slices the ranks returned (NaN where nobody wrote)."""
    shapes = {spec.name: spec.shape for spec in layouts(helpers().tiny_qwen2_tied())["gen"].params}
    full = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for r in results:
        for name, (slices, value) in r["slices"].items():
            full[name][slices] = value
    return full


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.fixture(scope="module")
def workers(ray_session):
    pool = ResourcePool([4], cpus_per_worker=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ReallocWorker))
    group.init_process_group(timeout_s=120)
    yield group
    pool.release()


@pytest.mark.distributed
def test_manager_reshards_only_stale_copies_and_blends_ema(workers):
    workers.setup(keep_copies=True)
    everyone = workers  # home ranks of the actor are all four, so U = all ranks for every actor call
    home = everyone.home_state("actor")[0]

    # 1. generation copy on ranks 2-3: built from the home layout.
    first = everyone.pre_call("actor", "gen")
    assert_same(assemble(first), home)
    assert [r["slices"] == {} for r in first] == [True, True, False, False]
    everyone.post_call("actor", "gen")  # kept: the actor keeps its copies

    # 2. nothing changed: the kept copy is reused without a reshard.
    again = everyone.pre_call("actor", "gen")
    assert [r["reshards"] for r in again] == [r["reshards"] for r in first]
    assert [r["module_id"] for r in again[2:]] == [r["module_id"] for r in first[2:]]
    everyone.post_call("actor", "gen")

    # 3. an optimizer step bumps the version: the next call reshards and carries the new weights.
    everyone.train_step()
    new_home = everyone.home_state("actor")[0]
    assert not torch.equal(new_home["model.norm.weight"], home["model.norm.weight"])
    third = everyone.pre_call("actor", "gen")
    assert [r["reshards"] for r in third] == [r["reshards"] + 1 for r in first]
    assert_same(assemble(third), new_home)
    everyone.post_call("actor", "gen")

    # 4. a pipeline layout over all ranks, then the EMA into the offloaded reference.
    assert_same(assemble(everyone.pre_call("actor", "infer")), new_home)
    everyone.post_call("actor", "infer")
    assert all(everyone.view([0, 1]).ref_is_offloaded())
    ref_before = everyone.view([0, 1]).home_state("ref")[0]
    everyone.ema(0.25)  # collective over both home layouts: all four ranks
    ref_ranks = everyone.view([0, 1])
    assert all(ref_ranks.ref_is_offloaded())  # put back to host after blending
    blended = assemble(ref_ranks.pre_call("ref", "ref_home"))
    ref_ranks.post_call("ref", "ref_home")
    expected = {n: torch.lerp(ref_before[n], new_home[n], 0.25) for n in new_home}
    assert_same(blended, expected)
    # A copy of the frozen reference elsewhere (ranks 0-3, pipeline) comes from its offloaded home.
    assert_same(assemble(everyone.pre_call("ref", "infer")), expected)
