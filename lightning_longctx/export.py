"""``longctx-export``: a ``longctx-train`` checkpoint -> a directory ``transformers.AutoModelForCausalLM``
loads (or a PEFT adapter).

1. The run's config: ``<run dir>/.hydra/config.yaml``, found by walking up from the checkpoint (``config=``
   overrides it). Only ``model``, ``memory``, ``task.mode`` and ``tokenizer.path`` are read; relative paths in
   ``model.pretrained`` / ``tokenizer.path`` are taken from the run's working directory (``.hydra/hydra.yaml``)
   when they do not exist from here.
2. The model is built as the run built it (:func:`lightning_longctx.app.build_model`: ``DecoderLM``, LoRA
   adapters, or the run's ``model._target_`` builder), and the checkpoint's parameters are loaded into it:
   from a ``torch.save`` file (``UlyssesStrategy`` with replicas: rank 0 writes one file; memory-mapped), or
   from a sharded checkpoint directory (FSDP2: ``torch.distributed.checkpoint`` shards plus ``meta.pt``), read
   offline with ``torch.distributed.checkpoint.load`` (no process group), only the model's entries (not the
   optimizer states). Neither can run code from the file (:mod:`.safe_load`: weights-only, DCP metadata types
   only) unless ``trust_checkpoint=true``. The LightningModule's prefix (``model.``) is found by matching the
   model's own keys.
3. Written with ``DecoderLM.save_pretrained`` (config.json + safetensors); with LoRA, merged into the base
   weights (``merge_lora``) by default, or ``adapter_only=true``: the PEFT adapter (``save_adapter``, with
   ``base_model_name_or_path`` = the run's ``model.pretrained``). The run's tokenizer files are copied along.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .app import build_model
from .checkpoint_paths import resolve_ckpt_path
from .safe_load import is_sharded, load_sharded, load_torch_file, read_dcp_metadata

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


class ExportError(ValueError):
    """A checkpoint or run config that cannot be exported (the message says why)."""


# ------------------------------------------------------------------------------------------------ locating
def resolve_checkpoint(ckpt: str | os.PathLike) -> Path:
    """A checkpoint file or sharded directory; ``last.ckpt`` (a link) and a run or checkpoints directory (its
    ``last.ckpt``) resolve to what they point at."""
    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"ckpt={ckpt}: no such checkpoint")
    return Path(resolve_ckpt_path(str(path), path))


def find_run_config(ckpt: Path) -> Path:
    """``<run dir>/.hydra/config.yaml`` of the run that wrote ``ckpt`` (searched upwards from it)."""
    for parent in [ckpt, *ckpt.parents][:6]:
        candidate = parent / ".hydra" / "config.yaml"
        if candidate.is_file():
            return candidate
    raise ExportError(f"no .hydra/config.yaml found above {ckpt} (the run directory's config); pass "
                      "config=<run dir>/.hydra/config.yaml")


def _from_run_cwd(value: str | None, config_path: Path) -> str | None:
    """A relative path of the run's config, as the run saw it (from its working directory)."""
    if not value or os.path.isabs(value) or os.path.exists(value):
        return value
    hydra_yaml = config_path.parent / "hydra.yaml"
    if hydra_yaml.is_file():
        cwd = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.cwd")
        if cwd and os.path.exists(os.path.join(cwd, value)):
            return os.path.join(cwd, value)
    return value


def load_run_config(config_path: Path) -> DictConfig:
    """The run's config, with the parts export needs resolved (``${hydra:...}`` elsewhere is left alone)."""
    cfg = OmegaConf.load(config_path)
    for key in ("model", "memory", "task"):
        if key not in cfg:
            raise ExportError(f"{config_path}: not a longctx-train config (no {key!r} node)")
    out = OmegaConf.create({
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "memory": OmegaConf.to_container(cfg.memory, resolve=True),
        "task": {"mode": cfg.task.mode, "name": cfg.task.get("name", "?")},
    })
    out.model.pretrained = _from_run_cwd(out.model.get("pretrained"), config_path)
    tokenizer = OmegaConf.select(cfg, "tokenizer.path", default=None, throw_on_resolution_failure=False)
    out.tokenizer = {"path": _from_run_cwd(tokenizer, config_path)}
    return out


# ------------------------------------------------------------------------------------------------ loading
def checkpoint_keys(path: Path, *, trust: bool = False) -> list[str]:
    """The LightningModule state-dict keys of a checkpoint (file or sharded directory)."""
    if is_sharded(path):
        metadata = read_dcp_metadata(path, trust=trust)
        return [k[len("state_dict."):] for k in metadata.state_dict_metadata if k.startswith("state_dict.")]
    return list(_load_file(path, trust)["state_dict"])


_FILE_CACHE: dict[tuple[str, bool], Any] = {}


def _load_file(path: Path, trust: bool) -> dict[str, Any]:
    key = (str(path), trust)
    if key not in _FILE_CACHE:
        _FILE_CACHE.clear()
        _FILE_CACHE[key] = load_torch_file(path, trust=trust, mmap=True)
    return _FILE_CACHE[key]


def module_prefix(model_keys: list[str], ckpt_keys: list[str]) -> str:
    """The prefix of the model's keys in the LightningModule's state dict (``model.`` for ``self.model``)."""
    present = set(ckpt_keys)
    candidates = ["model."] + sorted({k[: -len(model_keys[0])] for k in ckpt_keys if k.endswith(model_keys[0])})
    for prefix in candidates:
        if all(prefix + k in present for k in model_keys):
            return prefix
    missing = [k for k in model_keys if "model." + k not in present][:5]
    raise ExportError(f"the checkpoint does not hold this model's parameters (e.g. model.{missing[0]} is missing; "
                      f"it has {sorted(present)[:5]} ...): was it written by this run's config?")


def load_checkpoint_weights(model: torch.nn.Module, path: Path, *, trust: bool = False) -> None:
    """Load ``model``'s parameters and buffers from a ``longctx-train`` checkpoint (file or sharded directory);
    ``trust``: the file may unpickle any type (see :mod:`.safe_load`)."""
    expected = model.state_dict()
    aliases = _aliases(model)
    names = [k for k in expected if k not in aliases]
    prefix = module_prefix(names, checkpoint_keys(path, trust=trust))
    if is_sharded(path):
        target = {f"state_dict.{prefix}{k}": torch.empty_like(expected[k], device="cpu") for k in names}
        load_sharded(path, target, trust=trust)  # the flattened names DCP stores
        loaded = {k: target[f"state_dict.{prefix}{k}"] for k in names}
    else:
        state = _load_file(path, trust)["state_dict"]
        loaded = {k: state[prefix + k] for k in names}
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if k not in aliases]
    if missing or unexpected:
        raise ExportError(f"loading {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _aliases(model: torch.nn.Module) -> set[str]:
    """State-dict keys naming a tensor an earlier key already holds (tied weights: loaded through that key)."""
    seen: set[int] = set()
    aliases = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases.add(key)
        seen.add(id(value))
    return aliases


# ------------------------------------------------------------------------------------------------ writing
def copy_tokenizer(source: str | None, out: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a directory) that exist into ``out`` (not over what is there)."""
    if not source or not os.path.isdir(source):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if src.is_file() and not (out / name).exists():
            shutil.copy2(src, out / name)
            copied.append(name)
    return copied


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, *, adapter_only: bool = False,
                      dtype: str | None = None, config: str | os.PathLike | None = None,
                      trust_checkpoint: bool = False) -> Path:
    """Export ``ckpt`` to ``out`` (see the module docstring); returns ``out``. ``trust_checkpoint``: the file
    may unpickle any type (only for files one trusts: a pickle can run code)."""
    path = resolve_checkpoint(ckpt)
    checkpoint_keys(path, trust=trust_checkpoint)  # a refused file fails here, before the model is built
    config_path = Path(config) if config else find_run_config(path)
    cfg = load_run_config(config_path)
    if cfg.get("memory") is not None and "keep_attention_output" in cfg.memory:
        cfg.memory.keep_attention_output = "off"  # a training-time knob: no plan to run, weights unaffected
    out = Path(out)
    model = build_model(cfg)
    load_checkpoint_weights(model, path, trust=trust_checkpoint)
    has_lora = bool(getattr(model, "has_lora", lambda: False)())
    if adapter_only and not has_lora:
        raise ExportError("adapter_only=true needs a LoRA run (model.lora.r set); this checkpoint has full weights")
    if has_lora and not adapter_only:
        model.merge_lora()  # in the trained precision, before any cast
    if dtype is not None:
        torch_dtype = getattr(torch, str(dtype), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ExportError(f"dtype={dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
        model.to(torch_dtype)
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        model.save_adapter(out)
        base = cfg.model.get("pretrained")
        adapter_config = out / "adapter_config.json"
        if base and adapter_config.is_file():
            values = json.loads(adapter_config.read_text())
            values["base_model_name_or_path"] = os.path.abspath(base)
            adapter_config.write_text(json.dumps(values, indent=2) + "\n")
    else:
        if not hasattr(model, "save_pretrained"):
            raise ExportError(f"the run's model ({type(model).__name__}) has no save_pretrained(out)")
        model.save_pretrained(out)
    copy_tokenizer(cfg.tokenizer.get("path"), out)
    return out


__all__ = ["ExportError", "checkpoint_keys", "copy_tokenizer", "export_checkpoint", "find_run_config",
           "load_checkpoint_weights", "load_run_config", "module_prefix", "resolve_checkpoint"]
