"""A model or tokenizer named by local directory or Hugging Face Hub id, resolved to a local directory.

As in ``transformers``' ``from_pretrained``: a name that is no local directory is a Hub id, which
``huggingface_hub`` resolves once, on the driver, to its snapshot in the HF cache (downloading it
where the network allows; ``HF_HUB_OFFLINE=1`` reads the cache alone). Workers then read that
snapshot directory with ``local_files_only=True``, so no worker touches the network.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError

from rlflow.trainer.config import ConfigError

__all__ = ["resolve_model_dir"]


def resolve_model_dir(key: str, name: str | os.PathLike, base: str | Path | None = None) -> str:
    """The absolute local directory of ``name``: a directory as it is, else a Hub id's cached snapshot.

    Args:
        key: the config field or argument that gave ``name`` (``models.actor.path``, ``model``...),
            named by the error.
        name: a local directory (relative to ``base``, ``~`` expanded), or a Hub id (``org/name``).
        base: the directory a relative path is read from; default: the current directory.

    Returns:
        The directory's absolute path, or the snapshot directory of the id's ``main`` revision.

    Raises:
        ConfigError: ``name`` is no local directory and no model on the Hub or in its cache; the
            message says how to get it into the cache.

    >>> resolve_model_dir("models.actor.path", "/")
    '/'
    """
    base = Path.cwd() if base is None else Path(base)
    local = Path(os.path.abspath(base / Path(name).expanduser()))
    if local.exists():
        return str(local)
    where = "" if Path(name).expanduser().is_absolute() else f" (resolved against {base})"
    try:
        return snapshot_download(str(name))
    except (OSError, ValueError, HfHubHTTPError) as err:  # not cached offline, unreachable, a bad id, not found
        if isinstance(err, ValueError) and not isinstance(err, HfHubHTTPError):
            reason = f"nor a valid Hugging Face Hub id ({err})"  # huggingface_hub's HFValidationError
        elif constants.HF_HUB_OFFLINE:
            reason = (
                f"nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), which alone is read under "
                f"HF_HUB_OFFLINE=1; get it with `huggingface-cli download {name}` where the network "
                "allows, or unset HF_HUB_OFFLINE"
            )
        else:
            reason = (
                f"nor a model found on the Hugging Face Hub or in its cache ({constants.HF_HUB_CACHE}): "
                f"{type(err).__name__}: {_first_line(err)}; check the id, or get it with "
                f"`huggingface-cli download {name}` where the network allows"
            )
        raise ConfigError(key, f"{str(name)!r} does not exist as a local directory{where}, {reason}") from None


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else ""
