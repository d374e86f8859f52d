"""Progress bars follow the terminal (``logging.progress: auto``) unless the config says always or
never: a log file (``ray job submit``'s) gets no carriage returns."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from rlflow.trainer import Trainer
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.metrics import progress, show_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


CASES = [  # (logging.progress, stderr is a terminal, bar shown)
    ("auto", True, True),
    ("auto", False, False),
    ("always", False, True),
    ("never", True, False),
]


@pytest.mark.parametrize(("mode", "terminal", "shown"), CASES)
def test_a_bar_follows_logging_progress(monkeypatch, mode, terminal, shown):
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)  # tqdm's file, read as a bar is made
    with progress(4, "train", show=show_progress(mode)) as bar:
        bar.update(2)
        assert bool(bar.disable) is not shown  # closing disables every bar
    assert ("train:  50%" in err.getvalue()) is shown


def test_the_mode_is_a_config_field():
    assert load_config(None).logging.progress == "auto"
    assert load_config(None, ["logging.progress=never"]).logging.progress == "never"
    with pytest.raises(ConfigError, match=r"logging.progress: 'sometimes' is not allowed; expected one of \['auto'"):
        load_config(None, ["logging.progress=sometimes"])


@pytest.mark.parametrize(
    ("mode", "argument", "expected"), [("never", None, False), ("auto", None, None), ("never", True, True)]
)
def test_the_trainer_reads_the_mode_unless_told(tmp_path, mode, argument, expected):
    overrides = [f"logging.progress={mode}", "logging.level=warning", "placement.worker_host=driver"]
    with Trainer(None, overrides=[*overrides, f"logging.dir={tmp_path}"], progress_bars=argument) as trainer:
        assert trainer.progress_bars is expected
        assert logging.getLogger("rlflow").level == logging.WARNING  # logging.level, set by the driver
