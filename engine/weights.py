"""Loading Hugging Face ``*.safetensors`` weights into a module named exactly like the HF model.

``load_weights(module, path, dtype, device)`` works in two passes so that a bad checkpoint never
leaves a half-loaded module behind:

1. **Plan**: find the files (``model.safetensors.index.json``'s ``weight_map`` when present, else
   every ``*.safetensors`` in the directory), read only their headers, and compare names and shapes
   with the module's parameters. Missing, unexpected or mis-shaped tensors raise one
   ``ModelLoadError`` that names them all (up to a few dozen).
2. **Load**: one tensor at a time from a zero-copy view of the memory-mapped file
   (``engine.weight_upload``): to a GPU through pinned staging buffers with several chunks in
   flight, to the CPU in one copy; the dtype is converted on the target. No tensor is materialised
   in host memory first, so an 8B model loads into a GPU (or a ``meta``-initialised module) without
   a CPU copy of the checkpoint. The load is a boot phase (``pdserve.process_stats.BOOT``).

Tensor parallelism: ``slices`` (``CausalLM.tp_slices()``) names the parameters that hold only a
rank's part of a checkpoint tensor (``engine.tp_shard.TensorSlice``); those are read with
``safe_open(...).get_slice`` so a rank reads and holds its part only, never the whole tensor.

Tolerated extras, as ``transformers`` tolerates them: rotary ``inv_freq`` buffers that old Llama
checkpoints carry, and ``lm_head.weight`` stored by a checkpoint whose module ties it to the
embedding (the module then has no separate ``lm_head.weight`` parameter).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine import early_upload
from engine.errors import ModelLoadError
from engine.kv_layout import dtype_name
from engine.tp_shard import TensorSlice
from engine.weight_upload import MappedFile, Uploader
from pdserve.process_stats import BOOT

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_MAX_NAMED = 24  # how many names an error message lists before "... and N more"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LoadStats:
    num_tensors: int
    num_bytes: int  # bytes as stored in the module (after dtype conversion)
    files: tuple[str, ...]


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map tensor name -> the safetensors file holding it, reading only headers."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist or is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        return _from_index(index)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (expected {SINGLE_FILE} or a sharded "
                             f"set with {INDEX_FILE})")
    names: dict[str, Path] = {}
    for file in files:
        for name in _header_names(file):
            if name in names:
                raise ModelLoadError(f"tensor {name!r} appears in both {names[name].name} and {file.name}")
            names[name] = file
    return names


def iter_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, file by file (CPU, stored dtype)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(path).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                yield name, f.get_tensor(name)


def load_weights(module: torch.nn.Module, path: str | Path, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | None = None, *,
                 slices: dict[str, TensorSlice] | None = None) -> LoadStats:
    """Fill ``module``'s parameters from the checkpoint at ``path`` (strict names and shapes).

    ``dtype``/``device`` default to each parameter's own (or CPU for a meta parameter). Parameters
    on the ``meta`` device are replaced by real ones, so a model built under ``torch.device("meta")``
    is materialised tensor by tensor. ``slices``: parameters that take only part of their tensor.
    """
    path = Path(path)
    target_dtype = _DTYPES[dtype_name(dtype)] if dtype is not None else None
    params = dict(module.named_parameters())  # tied parameters appear once, under their first name
    located = checkpoint_files(path)
    slices = slices or {}
    plan = _plan(params, located, path, slices)
    total_bytes = 0
    uploaders: dict[torch.device, Uploader] = {}
    owners = _parameter_owners(module)
    early = early_upload.current()  # the bytes may be on the device already (engine/early_upload.py)
    used_early = False
    with BOOT.phase("load_weights"):
        for file, names in plan.items():
            # unmapped on a thread once read (MappedFile.close)
            with _open(file) as f, MappedFile(file, close_in_background=True) as mapped:
                for name in names:
                    param = params[name]
                    dt = target_dtype or param.dtype
                    dev = torch.device(device) if device is not None else (
                        torch.device("cpu") if param.is_meta else param.device)
                    sl = slices.get(name)
                    # in place where the parameter is already there (FusedLinears' views), else replaced
                    keep = not param.is_meta and param.dtype == dt and param.device == dev
                    on_device = _early_view(early, file, name, dev) if sl is None else None
                    if on_device is not None:  # uploaded while torch was imported: a device copy
                        into = param.data if keep and param.is_contiguous() else None
                        tensor = into.copy_(on_device) if into is not None else on_device.to(dt, copy=True)
                        used_early = True
                        del on_device
                    elif sl is None:  # zero-copy view of the mapped file, staged to the device
                        up = uploaders.get(dev) or uploaders.setdefault(dev, Uploader(dev))
                        into = param.data if keep and param.is_contiguous() else None
                        tensor = up.to(mapped.view(name), dt, out=into)
                    else:
                        tensor = slice_of(f.get_slice(name), sl).to(device=dev, dtype=dt)
                    if not keep:
                        _replace_parameter(owners, param, tensor)
                    elif tensor.data_ptr() != param.data_ptr():
                        with torch.no_grad():
                            param.copy_(tensor)
                    total_bytes += tensor.numel() * tensor.element_size()
                    del tensor
        for up in uploaders.values():
            up.finish()
        if early is not None:
            if used_early:
                early.synchronize()  # every copy out of the arena is done
            early.release()  # before the KV cache is sized from what is free
    loaded = sum(len(v) for v in plan.values())
    return LoadStats(num_tensors=loaded, num_bytes=total_bytes,
                     files=tuple(sorted({p.name for p in plan})))


# -- internals -------------------------------------------------------------------------------
def _early_view(early, file: Path, name: str, dev: torch.device) -> torch.Tensor | None:
    """``name``'s bytes already on ``dev`` (the early upload's arena), or None: no upload, another
    device, or it failed (the load then reads the file)."""
    return early.view(file, name) if early is not None and early.covers(dev) else None


def slice_of(source, sl: TensorSlice) -> torch.Tensor:
    """``sl``'s part of ``source`` (a tensor, or a safetensors slice that reads only that part),
    zero-padded past the stored size (the last rank's share of a vocabulary)."""
    index = (slice(sl.start, sl.stop),) if sl.dim == 0 else (slice(None), slice(sl.start, sl.stop))
    part = source[index]
    if sl.stop - sl.start == sl.length:
        return part
    shape = list(part.shape)
    shape[sl.dim] = sl.length
    out = part.new_zeros(shape)
    out.narrow(sl.dim, 0, sl.stop - sl.start).copy_(part)
    return out


def _plan(params: dict[str, torch.nn.Parameter], located: dict[str, Path],
          path: Path, slices: dict[str, TensorSlice]) -> dict[Path, list[str]]:
    """Check names/shapes against the headers; return file -> names to load, in file order."""
    ignorable = {n for n in located if _IGNORED.search(n)}
    if "lm_head.weight" in located and "lm_head.weight" not in params:
        ignorable.add("lm_head.weight")  # tied embedding: the checkpoint stores a redundant copy
    missing = sorted(set(params) - set(located))
    unexpected = sorted(set(located) - set(params) - ignorable)
    problems = []
    if missing:
        problems.append(f"missing tensors {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_names(unexpected)}")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name in located:
            by_file.setdefault(located[name], []).append(name)
    mismatched = []
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                want = list(params[name].shape)
                if name in slices:  # the rank's parameter is a slice of the whole checkpoint tensor
                    want[slices[name].dim] = slices[name].full
                if shape != tuple(want):
                    mismatched.append(f"{name}: checkpoint {list(shape)} vs model {want}")
    if mismatched:
        problems.append(f"mis-shaped tensors {_names(mismatched)}")
    if problems:
        raise ModelLoadError(f"weights in {path} do not match the model: " + "; ".join(problems))
    return by_file


def _from_index(index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{index} is not valid JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no 'weight_map' object")
    names: dict[str, Path] = {}
    headers: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        file = index.parent / str(shard)
        if file.parent != index.parent:
            raise ModelLoadError(f"{index}: shard {shard!r} for {name!r} is outside the model directory")
        if shard not in headers:
            if not file.is_file():
                raise ModelLoadError(f"{index} names shard {shard!r} (for {name!r}) but {file} is missing")
            headers[shard] = set(_header_names(file))
        if name not in headers[shard]:
            raise ModelLoadError(f"{index} places {name!r} in {shard!r}, but that shard does not hold it")
        names[name] = file
    return names


def _header_names(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


class _open:
    """``safe_open`` whose failures (truncated/corrupt file) become ModelLoadError naming the file."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def __enter__(self):
        try:
            self._ctx = safe_open(str(self.file), framework="pt", device="cpu")
            return self._ctx.__enter__()
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read safetensors file {self.file}: {exc}") from None

    def __exit__(self, *exc_info) -> None:
        self._ctx.__exit__(*exc_info)


def _parameter_owners(module: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) -> every (submodule, attribute) holding it: a tied parameter has several. Built
    once per load (walking every module per parameter cost ~0.5 s on an 8B model's 291 tensors)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for sub in module.modules():
        for key, value in sub._parameters.items():
            if value is not None:
                owners.setdefault(id(value), []).append((sub, key))
    return owners


def _replace_parameter(owners: dict[int, list[tuple[torch.nn.Module, str]]], old: torch.nn.Parameter,
                       tensor: torch.Tensor) -> None:
    """Every attribute that held ``old`` (ties intact) now holds a parameter over ``tensor``."""
    new = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
    for sub, key in owners[id(old)]:  # ``old`` stays alive (the caller's name map), so its id does too
        sub._parameters[key] = new


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMED])
    extra = len(items) - _MAX_NAMED
    return f"[{shown}{f', ... and {extra} more' if extra > 0 else ''}]"


def sample_indices(n: int, k: int) -> torch.Tensor:
    """``min(k, n)`` evenly spaced int64 indices of ``range(n)``, first and last included, exact.

    Integer arithmetic: a float32 ``linspace`` (the default dtype, and what CUDA computes) rounds
    ``n - 1`` up to ``n`` once ``n`` passes 2**24, e.g. Llama-3's 525M-element embedding, and the
    gather then reads out of bounds (a device-side assert on CUDA).
    """
    k = min(k, n)
    if k <= 1:
        return torch.zeros(k, dtype=torch.int64)
    return torch.arange(k, dtype=torch.int64) * (n - 1) // (k - 1)


def weights_fingerprint(module: torch.nn.Module, samples_per_tensor: int = 16) -> str:
    """Short hash of the loaded weights: names, shapes and a few evenly spaced values of each.

    ``ModelConfig.fingerprint()`` only covers the architecture, so two checkpoints of the same
    shape (two random seeds, a base model and its fine-tune) would look interchangeable. KV
    computed by one is garbage to the other, so the KV layout's model fingerprint includes this.
    Sampling keeps it cheap for an 8B model (one small gather per tensor, one copy to the host);
    values are compared as float32 so the hash depends on the weights and dtype, not the device.
    """
    import hashlib

    h = hashlib.sha256()
    picks = []
    for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(param.shape)}:{dtype_name(param.dtype)};".encode())
        flat = param.detach().reshape(-1)
        idx = sample_indices(flat.numel(), samples_per_tensor).to(flat.device)
        picks.append(flat.index_select(0, idx).float())
    if picks:
        h.update(torch.cat(picks).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
