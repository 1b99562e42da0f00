"""The DeepSeek-V4 checkpoint expert format: writer, lazy per-rank loader, rank -> expert range.

Per expert e of layer l, six tensors (safetensors, any number of shard files):

    layers.{l}.ffn.experts.{e}.w1.weight  int8              [I, H/2]   gate, packed e2m1
    layers.{l}.ffn.experts.{e}.w3.weight  int8              [I, H/2]   up
    layers.{l}.ffn.experts.{e}.w2.weight  int8              [H, I/2]   down
    layers.{l}.ffn.experts.{e}.w{1,3,2}.scale  float8_e8m0fnu [rows, K/32]  one E8M0 byte per 32 K values

Byte i of a row holds K[2i] in the low nibble and K[2i+1] in the high one; scales have no swizzle.
``load_layer`` stacks them into ``MXFP4Weights``: l1 = [w1; w3] -> [E, 2I, H/2], l2 = w2 -> [E, H, I/2],
all as uint8 (a bit-preserving view of the int8 / e8m0 storage).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats import MXFP4_BLOCK
from ..validate import as_int, check_scale_bytes
from ..weights import MXFP4Weights

INDEX_FILE = "model.safetensors.index.json"


class UnlistedShardWarning(UserWarning):
    """A checkpoint folder holds ``*.safetensors`` shards its index does not name (they are not read)."""

E8M0 = torch.float8_e8m0fnu
_PARTS = ("w1", "w3", "w2")


def tensor_name(layer: int, expert: int, part: str, kind: str) -> str:
    """``layers.{layer}.ffn.experts.{expert}.{part}.{kind}``; part in w1/w2/w3, kind weight/scale."""
    return f"layers.{layer}.ffn.experts.{expert}.{part}.{kind}"


def expert_range_for_rank(num_experts: int, num_ranks: int, rank: int) -> range:
    """Experts [rank * E_l, (rank + 1) * E_l) with E_l = E / R (contiguous EP sharding)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_ranks <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_ranks must divide num_experts={num_experts}, got num_ranks={num_ranks}")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    per = num_experts // num_ranks
    return range(rank * per, (rank + 1) * per)


# ------------------------------------------------------------------------------------ writer
def _expert_tensors(weights: MXFP4Weights, layer: int, e: int, global_e: int) -> dict[str, torch.Tensor]:
    i = weights.intermediate
    l1, s1 = weights.l1[e].cpu(), weights.l1_scale[e].cpu()
    parts = {
        "w1": (l1[:i], s1[:i]),
        "w3": (l1[i:], s1[i:]),
        "w2": (weights.l2[e].cpu(), weights.l2_scale[e].cpu()),
    }
    out = {}
    for part, (packed, scale) in parts.items():
        out[tensor_name(layer, global_e, part, "weight")] = packed.contiguous().view(torch.int8)
        out[tensor_name(layer, global_e, part, "scale")] = scale.contiguous().view(E8M0)
    return out


def write_checkpoint(
    directory, layer: int, weights: MXFP4Weights, num_files: int = 2, *, first_expert: int = 0,
    write_index: bool = True,
) -> list[Path]:
    """Write ``weights`` as DeepSeek-V4 checkpoint shards ``model-0000k-of-0000n.safetensors``.

    Experts are split into ``num_files`` contiguous runs (expert ``e`` of ``weights`` is stored as
    global expert ``first_expert + e``). With ``write_index`` a ``model.safetensors.index.json``
    weight map is written too. Returns the shard paths. The format has no global scales, so
    weights carrying non-unit ones are refused.
    """
    from safetensors.torch import save_file

    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    for name in ("l1_global_scale", "l2_global_scale"):
        gs = getattr(weights, name)
        if gs is not None and not bool((gs == 1).all()):
            raise ValueError(f"the DeepSeek-V4 checkpoint format has no global scales, but weights.{name} is not all 1")
    e_total = weights.num_experts
    if not 1 <= num_files <= e_total:
        raise ValueError(f"num_files must be in [1, {e_total}] (one expert at least per file), got {num_files}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = [round(k * e_total / num_files) for k in range(num_files + 1)]
    paths, weight_map = [], {}
    for k in range(num_files):
        path = directory / f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        tensors = {}
        for e in range(bounds[k], bounds[k + 1]):
            tensors.update(_expert_tensors(weights, layer, e, first_expert + e))
        save_file(tensors, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in tensors})
        paths.append(path)
    if write_index:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return paths


# ------------------------------------------------------------------------------------ loader
@dataclass(frozen=True)
class CheckpointIndex:
    """Tensor name -> shard file, from ``model.safetensors.index.json`` or from every shard's header."""

    directory: Path
    weight_map: dict[str, str]

    @classmethod
    def open(cls, directory) -> "CheckpointIndex":
        from safetensors import SafetensorError, safe_open

        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
        index = directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index (need a 'weight_map' object): {exc!r}") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                got = type(weight_map).__name__ if not isinstance(weight_map, dict) else "a dict with non-string entries"
                raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> shard file name, "
                                 f"got {got}")
            unlisted = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in set(weight_map.values()))
            if unlisted:  # the index decides; a shard it does not name (an old one left in the folder) is reported
                warnings.warn(f"{index}: shard(s) {unlisted} in {str(directory)!r} are not named in the index's "
                              "weight_map and are not read (the index decides where each tensor is)",
                              UnlistedShardWarning, stacklevel=3)
            return cls(directory, dict(weight_map))
        files = sorted(directory.glob("*.safetensors"))
        for path in files:
            if not path.is_file():
                raise ValueError(f"{path}: named like a safetensors shard but is not a regular file (a directory?)")
        if not files:
            raise FileNotFoundError(f"no *.safetensors files and no {INDEX_FILE} in {str(directory)!r}")
        weight_map = {}
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:  # reads the header only
                    names = list(f.keys())
            except SafetensorError as exc:
                raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt?): {exc}") from None
            for name in names:
                if name in weight_map:  # without an index nothing says which copy is meant: refuse, never pick one
                    raise ValueError(f"tensor {name!r} is in two shards, {directory / weight_map[name]} and {path}, and "
                                     f"there is no {INDEX_FILE} to say which to read; remove the stale shard or write "
                                     "an index")
                weight_map[name] = path.name
        return cls(directory, weight_map)

    def file_of(self, name: str) -> Path:
        try:
            return self.directory / self.weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {str(self.directory)!r}") from None


def _read(handles: dict, index: CheckpointIndex, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
    from safetensors import SafetensorError, safe_open

    path = index.file_of(name)
    if path not in handles:
        if not path.exists():
            raise FileNotFoundError(f"{path}: shard listed for tensor {name!r} does not exist")
        if not path.is_file():
            raise ValueError(f"{path}: shard listed for tensor {name!r} is not a regular file (a directory?)")
        try:
            handles[path] = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt?): {exc}") from None
    f = handles[path]
    if name not in f.keys():
        raise KeyError(f"tensor {name!r} is missing from {path} (the index lists it there)")
    t = f.get_tensor(name)
    if t.dtype != dtype:
        raise TypeError(f"{name} in {path.name} must have dtype {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} in {path.name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype == E8M0:
        check_scale_bytes(f"{name} in {path}", t.view(torch.uint8))  # 0xFF is NaN: refused at the file
    return t


def _expert_ids(index: CheckpointIndex, layer: int) -> list[int]:
    """The expert numbers of layer ``layer``'s tensors; any other tensor under its experts prefix (an
    ``...experts.bias``, a ``w4``) is refused, naming the tensor and its file."""
    prefix = f"layers.{layer}.ffn.experts."
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.(w1|w2|w3)\.(weight|scale)")
    ids = set()
    for name, file in index.weight_map.items():
        if not name.startswith(prefix):
            continue
        m = pattern.fullmatch(name)
        if m is None:
            raise ValueError(f"tensor {name!r} in {index.directory / file} is not a routed-expert tensor of layer "
                             f"{layer}: expected {prefix}{{e}}.w{{1,2,3}}.{{weight,scale}}")
        ids.add(int(m.group(1)))
    if not ids:
        raise KeyError(f"no tensors named {prefix}* (layer {layer}) in {str(index.directory)!r}")
    return sorted(ids)


def load_layer(directory, layer: int, *, experts: range | list[int] | None = None, device="cpu") -> MXFP4Weights:
    """Read layer ``layer``'s routed experts (all, or only ``experts``) -> ``MXFP4Weights`` on ``device``.

    Lazy: shards are opened with ``safe_open`` and only the requested experts' tensors are read.
    Expert j of the result is checkpoint expert ``experts[j]``. Shapes are taken from the first
    requested expert's w1 ([I, H/2]) and every other tensor is checked against them.
    Raises KeyError (missing tensor), TypeError (wrong dtype), ValueError (wrong shape, truncated file).
    """
    layer = as_int("layer", layer, lo=0, who="load_layer")
    index = CheckpointIndex.open(directory)
    if experts is None:
        experts = range(max(_expert_ids(index, layer)) + 1)
    experts = [as_int("experts[i]", e, lo=0, who="load_layer") for e in experts]
    if not experts:
        raise ValueError("experts must name at least one expert")
    if len(set(experts)) != len(experts):
        raise ValueError(f"load_layer: experts must be distinct, got {experts}")
    handles: dict = {}
    try:
        first = _read(handles, index, tensor_name(layer, experts[0], "w1", "weight"), torch.int8, None)
        if first.ndim != 2:
            raise ValueError(f"{tensor_name(layer, experts[0], 'w1', 'weight')} must be 2-D [I, H/2], got {tuple(first.shape)}")
        i, h = first.shape[0], first.shape[1] * 2
        if h % MXFP4_BLOCK or i % MXFP4_BLOCK:
            raise ValueError(f"H={h} and I={i} must be multiples of {MXFP4_BLOCK} (one E8M0 scale per 32)")
        shapes = {"w1": (i, h), "w3": (i, h), "w2": (h, i)}  # (rows, K)
        l1, s1, l2, s2 = [], [], [], []
        for e in experts:
            got = {}
            for part, (rows, k) in shapes.items():
                w = _read(handles, index, tensor_name(layer, e, part, "weight"), torch.int8, (rows, k // 2))
                s = _read(handles, index, tensor_name(layer, e, part, "scale"), E8M0, (rows, k // MXFP4_BLOCK))
                got[part] = (w.view(torch.uint8), s.view(torch.uint8))
            l1.append(torch.cat([got["w1"][0], got["w3"][0]]))
            s1.append(torch.cat([got["w1"][1], got["w3"][1]]))
            l2.append(got["w2"][0])
            s2.append(got["w2"][1])
    finally:
        handles.clear()  # safe_open handles close when dropped
    stack = lambda ts: torch.stack(ts).to(device)  # noqa: E731
    return MXFP4Weights(stack(l1), stack(s1), stack(l2), stack(s2))
