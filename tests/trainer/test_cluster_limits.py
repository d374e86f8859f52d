"""Refusing what cannot run (issue 15): a local Ray is never sized beyond the machine, and more
nodes or devices than the cluster has is a ``ResourceError`` naming the field and what the cluster
has — in every placement mode, before the planner or any worker starts.

Before: ``placement.devices_per_node=8`` on 2 cores started 8 workers on a Ray sized to fit them
and made no step in 110 s; ``placement.num_nodes=2`` on one node failed in heuristic mode with a
pipeline planning error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from recipe_helpers import TINY

from rlflow.controller import ResourceError
from rlflow.trainer import Trainer, build, load_config

GRPO = Path(__file__).parents[2] / "recipes" / "grpo_arithmetic.yaml"
MODES = ("auto", "heuristic", "colocated", "manual")


def mode_overrides(mode: str, num_nodes: int = 1, devices_per_node: int = 1) -> list[str]:
    """``placement.mode=<mode>``; in manual mode, data parallel over whole hosts for each device call."""
    if mode != "manual":
        return [f"placement.mode={mode}"]
    out = ["placement.mode=manual"]
    for call in ("actor_gen", "actor_train"):
        key = f"placement.manual.{call}"
        out += [f"{key}.mesh.num_nodes={num_nodes}", f"{key}.mesh.num_devices={devices_per_node}"]
        out += [f"{key}.strategy.dp={num_nodes * devices_per_node}"]
    return out


# ------------------------------------------------------------------ a local Ray fits the machine
def test_more_cpu_workers_than_cores_are_refused_naming_the_fields():
    cfg = load_config(None, ["placement.devices_per_node=8"])
    with pytest.raises(ResourceError) as err:
        build.local_ray_cpus(cfg, cores=2)
    message = str(err.value)
    assert message.startswith("placement.devices_per_node=8 asks for 8 CPU workers but this machine has 2 cores")
    assert "placement.cpus_per_worker=1" in message and "placement.oversubscribe=true" in message


def test_a_local_ray_gets_the_cores_unless_oversubscription_is_asked_for():
    assert build.local_ray_cpus(load_config(None, ["placement.devices_per_node=2"]), cores=2) == 2
    # Fractional workers that fit the cores need no override.
    quarter = ["placement.devices_per_node=8", "placement.cpus_per_worker=0.25"]
    assert build.local_ray_cpus(load_config(None, quarter), cores=2) == 2
    over = ["placement.devices_per_node=8", "placement.oversubscribe=true"]
    assert build.local_ray_cpus(load_config(None, over), cores=2) == 8


def test_ensure_ray_refuses_before_ray_starts(monkeypatch):
    started = []
    monkeypatch.setattr(build.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(build.ray, "init", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(build, "local_devices_per_node", lambda use_gpu=None: 2)
    with pytest.raises(ResourceError, match="asks for 8 CPU workers but this machine has 2 cores"):
        build.ensure_ray(load_config(None, ["placement.devices_per_node=8"]))
    assert started == []


# ------------------------------------------------------------------ the cluster holds the request
@pytest.fixture
def refused_before_start(ray_session, monkeypatch):
    """Fails the test if the planner or the workers start: the refusal must come first."""

    def started(*args, **kwargs):
        raise AssertionError("the planner or the workers started before the request was refused")

    monkeypatch.setattr(Trainer, "_plan", started)
    monkeypatch.setattr(build, "start_workers", started)
    return ray.util.placement_group_table


@pytest.mark.parametrize("mode", MODES)
def test_more_nodes_than_the_cluster_has_are_refused_in_every_mode(refused_before_start, tmp_path, mode):
    groups_before = len(refused_before_start())
    cfg = load_config(GRPO, [*TINY, "placement.num_nodes=2", *mode_overrides(mode, 2, 2), f"logging.dir={tmp_path}"])
    with Trainer(cfg, progress_bars=False) as trainer:
        with pytest.raises(ResourceError, match=r"placement.num_nodes=2, but the Ray cluster has 1 node\(s\)"):
            trainer.launch()
        assert not trainer.launched
    assert len(refused_before_start()) == groups_before  # no placement group was reserved


@pytest.mark.parametrize("mode", MODES)
def test_more_devices_than_a_node_has_are_refused_in_every_mode(refused_before_start, tmp_path, mode):
    cpus = int(ray.cluster_resources()["CPU"])
    devices = cpus + 1
    cfg = load_config(
        GRPO, [*TINY, f"placement.devices_per_node={devices}", *mode_overrides(mode), f"logging.dir={tmp_path}"]
    )
    with Trainer(cfg, progress_bars=False) as trainer:
        with pytest.raises(ResourceError) as err:
            trainer.launch()
    message = str(err.value)
    assert message.startswith(f"placement.devices_per_node={devices} asks for {devices} CPU workers")
    assert f"{cpus} CPU" in message  # what the cluster's node has
