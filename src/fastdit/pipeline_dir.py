"""Checks of a local pipeline directory (``save_pretrained`` layout) that need no weights loaded.

A directory that cannot be loaded fails deep inside diffusers with an error about some file; these checks find the
common cases first and say what is wrong in the directory's terms: ``model_index.json`` unreadable, a component
folder it lists missing (``vae/``), a shard an index names missing, a ``.safetensors`` file cut short or with a
garbled header (from its header alone: the tensors are not read), or a directory holding another pipeline than the
one asked for. Each check raises :class:`ValueError` with the requirement; :mod:`fastdit.session` turns it into a
:class:`~fastdit.errors.FieldError` naming where the directory came from.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import struct
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["check_components", "check_pipeline_class", "check_safetensors", "read_index"]

MODULAR_INDEX = "modular_model_index.json"

# Libraries whose components save_pretrained always writes into a folder of their own name.
_SAVED_IN_FOLDERS = frozenset({"diffusers", "transformers"})

# safetensors refuses headers above 100 MB: a larger length field means the first bytes are not a header at all.
_MAX_HEADER_BYTES = 100_000_000


def read_index(path: Path) -> dict[str, Any]:
    """``path/model_index.json`` as a dict with a ``_class_name``; for a ModularPipeline's directory (no
    ``model_index.json``), its ``modular_model_index.json``.

    Raises:
        ValueError: If it cannot be read, is not a JSON object, or names no class.
    """
    name = "model_index.json" if (path / "model_index.json").is_file() else MODULAR_INDEX
    try:
        index = json.loads((path / name).read_text())
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise ValueError("not an object with a _class_name")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"unreadable {name} ({error})") from None
    return index


def _components(index: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The components ``model_index.json`` lists with a library and a class (``[null, null]`` is an empty slot);
    a ``modular_model_index.json`` entry is ``[library, class, loading spec]``."""
    found = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) not in (2, 3):
            continue
        library, class_name = entry[:2]
        if isinstance(library, str) and isinstance(class_name, str):
            found[name] = (library, class_name)
    return found


def _folder(index: Mapping[str, Any], name: str) -> str:
    """The folder of component ``name``: its own name, or a modular entry's ``subfolder``."""
    entry = index[name]
    spec = entry[2] if len(entry) == 3 and isinstance(entry[2], Mapping) else {}
    return spec.get("subfolder") or name


def check_safetensors(file: Path) -> None:
    """Check that a ``.safetensors`` file is as long as its header says, reading the header only.

    Raises:
        ValueError: If the file is shorter or longer than its header describes, or the header is not one.
    """
    size = file.stat().st_size
    with file.open("rb") as stream:
        head = stream.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{file.name} is truncated or not a safetensors file ({size} bytes, no complete header)")
        try:
            header = json.loads(stream.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ValueError(f"{file.name} has a garbled header (not safetensors JSON)") from None
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header describes"
        raise ValueError(f"{file.name} is {what} ({size} bytes, its header describes {expected}): copy it again")


def _check_shards(folder: Path) -> None:
    for index_file in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index_file.read_text())["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{folder.name}/{index_file.name} is unreadable (no weight_map)") from None
        missing = sorted(shard for shard in shards if not (folder / shard).is_file())
        if missing:
            raise ValueError(f"{folder.name}/{index_file.name} names missing shards: {', '.join(missing)}")


def check_components(path: Path, index: Mapping[str, Any]) -> None:
    """Check that every component ``index`` lists has its folder, its shards, and complete safetensors files.

    Raises:
        ValueError: Naming the first component folder or file that is missing or broken.
    """
    for name, (library, class_name) in _components(index).items():
        folder = path / _folder(index, name)
        if not folder.is_dir():
            if library not in _SAVED_IN_FOLDERS:
                continue  # e.g. a safety checker its own package fetches: not a file of this directory
            listed_in = MODULAR_INDEX if len(index[name]) == 3 else "model_index.json"
            raise ValueError(f"missing {folder.name}/: {listed_in} lists {name} ({library}.{class_name})")
        _check_shards(folder)
        for file in sorted(folder.glob("*.safetensors")):
            try:
                check_safetensors(file)
            except ValueError as error:
                raise ValueError(f"{name}/{error}") from None


def _annotation_names(annotation: Any) -> set[str]:
    """Class names an ``__init__`` annotation allows (``X``, ``X | None``, or the same as a string)."""
    if isinstance(annotation, str):  # postponed annotations: dotted names joined by "|"
        return {word.rpartition(".")[2] for word in re.findall(r"[A-Za-z_][\w.]*", annotation) if word != "None"}
    members = typing.get_args(annotation) or (annotation,)
    return {member.__name__ for member in members if isinstance(member, type) and member is not type(None)}


def _is_subclass_by_name(library: str, class_name: str, allowed: set[str]) -> bool:
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        return False
    return any(base.__name__ in allowed for base in inspect.getmro(cls)) if isinstance(cls, type) else False


def check_pipeline_class(index: Mapping[str, Any], pipeline_class: type) -> None:
    """Check that a directory holds what ``pipeline_class`` runs.

    The class ``model_index.json`` names may differ from ``pipeline_class`` (an image-to-video pipeline loads the
    text-to-video directory of its model), so what is compared is the denoiser: the directory's ``transformer``
    must be of a class ``pipeline_class`` takes as its ``transformer``.

    Raises:
        ValueError: If the denoisers differ, naming both pipelines.
    """
    if index["_class_name"] == pipeline_class.__name__:
        return
    listed = _components(index).get("transformer")
    parameter = inspect.signature(pipeline_class.__init__).parameters.get("transformer")
    if listed is None or parameter is None or parameter.annotation is inspect.Parameter.empty:
        return  # nothing to compare: leave it to loading
    allowed = _annotation_names(parameter.annotation)
    library, class_name = listed
    if not allowed or class_name in allowed or _is_subclass_by_name(library, class_name, allowed):
        return
    raise ValueError(
        f"holds a {index['_class_name']} (transformer {class_name}), not the {pipeline_class.__name__} "
        f"(transformer {' or '.join(sorted(allowed))})"
    )
