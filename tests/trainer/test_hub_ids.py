"""A model or tokenizer given by Hugging Face Hub id, as ``from_pretrained`` takes it: resolved once on
the driver to its snapshot in an offline HF cache laid out here by hand, which the workers read; an id
the cache lacks is refused with the field, the id and how to get it."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants
from tiny_fit import DRIVER_FIT, GRPO

from rlflow.data.tiny_models import save_tiny_model_and_tokenizer
from rlflow.trainer import ConfigError, Trainer, build, load_config
from rlflow.trainer.hub import resolve_model_dir

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
TINY = [*DRIVER_FIT, "rollout.max_new_tokens=4", "trainer.total_steps=2", "checkpoint.save_final=false"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline HF cache (HF_HUB_OFFLINE=1) holding ``org/tiny-lm``, laid out as huggingface_hub writes it."""
    repo = tmp_path / "hf" / "models--org--tiny-lm"
    snapshot = repo / "snapshots" / COMMIT
    save_tiny_model_and_tokenizer(snapshot, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE at import: set the module's constants as the env would.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(cfg, *args):
        raise AssertionError("started Ray")

    monkeypatch.setattr(build, "ensure_ray", refuse)


def test_a_local_directory_stays_local_and_an_id_becomes_its_snapshot(tmp_path, hub_cache, monkeypatch):
    (tmp_path / "org" / "tiny-lm").mkdir(parents=True)  # a local directory wins over the id it spells
    assert resolve_model_dir("models.actor.path", "org/tiny-lm", base=tmp_path) == str(tmp_path / "org" / "tiny-lm")
    monkeypatch.chdir(hub_cache)
    assert resolve_model_dir("models.actor.path", ".") == str(hub_cache)
    assert resolve_model_dir("models.actor.path", "org/tiny-lm", base=tmp_path / "elsewhere") == str(hub_cache)


def test_an_id_not_in_the_offline_cache_is_refused_saying_how_to_get_it(tmp_path, hub_cache):
    with pytest.raises(ConfigError) as err:
        resolve_model_dir("models.actor.path", "org/absent", base=tmp_path)
    message = str(err.value)
    assert err.value.key == "models.actor.path" and "'org/absent' does not exist as a local directory" in message
    assert "huggingface-cli download org/absent" in message and "unset HF_HUB_OFFLINE" in message
    with pytest.raises(ConfigError, match="data.tokenizer: 'a/b/c' .* nor a valid Hugging Face Hub id"):
        resolve_model_dir("data.tokenizer", "a/b/c", base=tmp_path)


def test_config_fields_given_by_id_resolve_before_any_worker(tmp_path, hub_cache, no_ray):
    overrides = ["models.actor.init=path", "models.actor.path=org/tiny-lm", "data.tokenizer=org/tiny-lm"]
    resolved = build.resolve_paths(load_config(GRPO, overrides), base=tmp_path)
    assert resolved.models["actor"].path == resolved.data.tokenizer == str(hub_cache)
    with pytest.raises(ConfigError) as err:
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run'}", "models.actor.init=path",
                                 "models.actor.path=org/absent"])  # fmt: skip
    assert err.value.key == "models.actor.path" and "huggingface-cli download org/absent" in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before the run directory is written


def test_trainer_model_by_id_takes_its_tokenizer_from_the_snapshot(tmp_path, hub_cache, no_ray):
    trainer = Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run'}"], model="org/tiny-lm")
    assert trainer.cfg.models["actor"].path == trainer.cfg.data.tokenizer == str(hub_cache)
    assert trainer.model_paths["actor"] == str(hub_cache)
    trainer.close()
    with pytest.raises(ConfigError, match="tokenizer: 'org/absent' does not exist .*huggingface-cli download"):
        Trainer(
            GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run2'}"], model="org/tiny-lm", tokenizer="org/absent"
        )


@pytest.mark.timeout(120)
def test_a_grpo_fit_from_a_hub_id_reads_the_cached_snapshot(tmp_path, hub_cache):
    overrides = [*TINY, f"logging.dir={tmp_path / 'run'}", "models.actor.init=path", "models.actor.path=org/tiny-lm"]
    with Trainer(GRPO, overrides=overrides, progress_bars=False) as trainer:
        assert trainer.fit().steps == 2
    assert trainer.setup.models["actor"].path == str(hub_cache)  # what the worker loaded
