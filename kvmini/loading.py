"""Load an HF-layout checkpoint folder (config.json + safetensors) into a `Transformer`.

Only safetensors are read (never pickle). Loading is strict: every tensor the
model needs must be present with the right shape, and nothing unknown may be
left over. The model is built on the meta device and the loaded tensors are
assigned in place, so no memory is spent on a random initialization.
"""
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvmini.config import ModelConfig
from kvmini.errors import KvminiError, not_special
from kvmini.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed here
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensors (HF names)


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; 'cpu', 'cuda' or 'cuda:N'. An absent GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::([0-9]+))?", name)
    if m is None:
        raise KvminiError(f"unsupported device {name!r}: kvmini runs on auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise KvminiError(f"device {name!r} requested but no CUDA GPU is available (try --device cpu)")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise KvminiError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise KvminiError(f"unknown dtype {name!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: one file, or the shards named by the index."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    for link in (single, index):
        if link.is_symlink() and not link.exists():
            raise KvminiError(f"{link} is a link to nothing ({link.readlink()})")
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(not_special(index, "shard index").read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise KvminiError(f"broken shard index {index}: {type(e).__name__}: {e}") from None
        if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
            raise KvminiError(f"broken shard index {index}: weight_map must map tensor names to file names")
        return [folder / name for name in names]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise KvminiError(f"{folder} holds only pickle weights (.bin/.pt); kvmini loads safetensors only")
    raise KvminiError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def readable_shard(path: Path) -> Path:
    if not path.exists():
        raise KvminiError(f"missing weight shard: {path}")
    if not path.is_file():
        raise KvminiError(f"{path} is not a file")
    path.open("rb").close()  # an unreadable file fails here with the OS's own reason
    return path


def layers_held(files: list[Path]) -> int:
    """How many decoder layers the checkpoint's tensors hold (model.layers.<i>.*), from the files' headers."""
    found = set()
    for path in files:
        try:
            with safe_open(str(readable_shard(path)), framework="pt", device="cpu") as f:
                found.update(int(m.group(1)) for name in f.keys() if (m := LAYER.match(name)))
        except SafetensorError as e:
            raise KvminiError(f"cannot read {path}: {e}") from None
    return max(found, default=-1) + 1


def load_model(folder: str | Path, device: str = "auto", dtype: str = "auto") -> Transformer:
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise KvminiError(f"{folder} is a file, not a checkpoint folder (config.json and safetensors)")
    if not folder.is_dir():
        raise KvminiError(f"model folder not found: {folder}")
    config = ModelConfig.from_file(folder / "config.json")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = safetensors_files(folder)
    held = layers_held(files)  # before the model is built, which a config of absurd size would make take forever
    if held != config.num_layers:
        raise KvminiError(f"config.json has num_hidden_layers {config.num_layers} but the weights in {folder} hold "
                          f"{held} layers: config and weights do not match")
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    if name not in expected:
                        raise KvminiError(f"unexpected tensor {name!r} in {path.name}")
                    t = f.get_tensor(name)
                    if not t.dtype.is_floating_point:
                        raise KvminiError(f"tensor {name!r} in {path.name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                                          "weights must be floating point")
                    if t.shape != expected[name]:
                        raise KvminiError(
                            f"shape mismatch for {name!r}: checkpoint {tuple(t.shape)}, model {tuple(expected[name])}"
                        )
                    state[name] = t.to(device=dev, dtype=dt)
        except SafetensorError as e:
            raise KvminiError(f"cannot read {path}: {e}") from None
    missing = [name for name in expected if name not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvminiError(f"missing tensor {missing[0]!r}{more} in {folder}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope(dev)
    return model.eval().requires_grad_(False)
