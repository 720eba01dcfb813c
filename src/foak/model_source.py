"""Where a ``--model`` of ``foak train`` / ``foak verify`` comes from: a local directory or a Hugging Face hub id,
checked before anything is loaded, so that a mistake is one clear ValueError rather than a loader's traceback.

- A path that exists is a local model: a directory with ``config.json`` (with a ``model_type``), weights
  (``*.safetensors`` or ``pytorch_model*.bin``) and, for training, tokenizer files. Anything else says what is
  missing. Its absolute path is what the model (and a LoRA adapter's ``base_model_name_or_path``) records.
- A name that does not exist and looks like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) is an error.
- Anything else is a hub id (``org/name``). ``HF_HUB_OFFLINE=1``: the local hub cache only. Otherwise one
  request for its ``config.json`` (no retries, ``HUB_TIMEOUT`` seconds): an unreachable hub falls back to the
  cache when the model is there (a warning; the cache only from then on) and is an error when it is not.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("foak.train")

HUB_TIMEOUT = 10.0  # seconds for the one request that checks a hub id (huggingface_hub's own default)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass
class ModelSource:
    """A checked ``--model``: ``ref`` is what the loaders get (an absolute local path or the hub id);
    ``config`` the parsed config.json; ``local_files_only`` True when only the hub cache may be used."""

    given: str
    ref: str
    config: dict
    hub: bool = False
    local_files_only: bool = False

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def local_dir(self) -> Path:
        """A local directory holding the model (a hub model is downloaded, or found in the cache)."""
        if not self.hub:
            return Path(self.ref)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(self.ref, local_files_only=self.local_files_only))

    def __str__(self) -> str:
        return f"{self.ref} (hub)" if self.hub else self.ref


def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or os.path.isabs(name)
            or name.endswith("/"))


def resolve_model(name: str, flag: str = "--model", need_tokenizer: bool = True) -> ModelSource:
    """The :class:`ModelSource` of ``name`` (see the module docstring); ValueError naming what is wrong."""
    path = Path(name).expanduser()
    if path.exists():
        return _local(name, path, flag, need_tokenizer)
    if _looks_like_path(name):
        raise ValueError(f"{flag} {name}: no such directory (for a model on the Hugging Face hub pass its id, "
                         "e.g. meta-llama/Llama-3.2-1B)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ValueError(f"{flag} {name}: no such local directory, and not a hub id ({e})") from None
    return _hub(name, flag)


def _read_config(config_path: Path, where: str) -> dict:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config.json holds a {type(config).__name__}, not a model config object")
    if not config.get("model_type"):
        raise ValueError(f"{where}: config.json has no model_type, so it is not a transformers model config")
    return config


def _local(name: str, path: Path, flag: str, need_tokenizer: bool) -> ModelSource:
    where = f"{flag} {name}"
    if not path.is_dir():
        raise ValueError(f"{where} is a file, not a model directory (pass the directory holding config.json "
                         "and the weights)")
    if not (path / "config.json").is_file():
        inside = sorted(p.parent.name for p in path.glob("*/config.json"))
        hint = f"; these subdirectories hold one: {', '.join(inside[:3])}" if inside else ""
        raise ValueError(f"{where} is a directory but not a Hugging Face model: it has no config.json{hint}")
    config = _read_config(path / "config.json", where)
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ValueError(f"{where} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
    if need_tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): save the "
                         "tokenizer into the model directory (tokenizer.save_pretrained(directory))")
    return ModelSource(name, str(path.resolve()), config)


def _hub(name: str, flag: str) -> ModelSource:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{flag} {name}"
    cache_only = bool(constants.HF_HUB_OFFLINE)
    if cache_only:
        config_path = try_to_load_from_cache(name, "config.json")
        if not isinstance(config_path, str):
            raise ValueError(f"{where}: not in the local hub cache, and HF_HUB_OFFLINE is set (cache only): "
                             "download it first (hf download " + name + "), or unset HF_HUB_OFFLINE")
        return ModelSource(name, name, _read_config(Path(config_path), where), hub=True, local_files_only=True)
    try:  # one request, no retries
        get_hf_file_metadata(hf_hub_url(name, "config.json", endpoint=constants.ENDPOINT), timeout=HUB_TIMEOUT)
    except GatedRepoError:
        raise ValueError(f"{where}: a gated model on the hub: accept its terms on its hub page and log in "
                         "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{where}: no such model on the hub (or a private one: log in with hf auth login); "
                         "for a local model pass its directory") from None
    except (RevisionNotFoundError, EntryNotFoundError):
        raise ValueError(f"{where}: the hub repository has no config.json, so it is not a transformers "
                         "model") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise ValueError(f"{where}: the hub answered HTTP {status} for its config.json") from None
    except Exception as e:  # the hub cannot be reached (DNS, refused connection, timeout, proxy)
        config_path = try_to_load_from_cache(name, "config.json")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not isinstance(config_path, str):
            raise ValueError(f"{where}: cannot reach the Hugging Face hub at {constants.ENDPOINT} ({reason}) "
                             "and the model is not in the local cache; check the network or proxy, or set "
                             "HF_HUB_OFFLINE=1 to use cached models only") from None
        log.warning(f"cannot reach the Hugging Face hub ({reason}): using the cached copy of {name}")
        return ModelSource(name, name, _read_config(Path(config_path), where), hub=True, local_files_only=True)
    config_path = hf_hub_download(name, "config.json")
    return ModelSource(name, name, _read_config(Path(config_path), where), hub=True)
