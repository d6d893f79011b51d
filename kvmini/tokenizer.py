"""Text <-> token ids for the three tokenizer formats HF checkpoints ship.

* tokenizer.json, byte-level BPE (SmolLM2, Qwen2/3, HF Llama-3): vocabulary and
  merges become tiktoken ranks; the pre-tokenizer becomes one regex.
* tokenizer.model, tiktoken text format (Meta's Llama-3 release).
* tokenizer.model, sentencepiece protobuf (Llama-2, Mistral).

Example (SmolLM2): encode("Hello 42") -> [19556, 216, 36, 34]: digits are split one by one.
"""
import base64
import codecs
import json
import unicodedata
from pathlib import Path

import regex

from kvmini.errors import KvminiError
from kvmini.files import not_special

# GPT-2's pre-tokenizer: contractions, letters, numbers, punctuation, whitespace runs.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual) then GPT-2, as one regex. A digit always stands alone, so a run of spaces
# before a digit must end there in one piece (the lookahead treats a digit like end of text).
DIGITS_GPT2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
# Meta's Llama-3 tokenizer.model pattern and special tokens (Llama-3.1 naming).
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 bytes to printable characters ('Ġ' is the space byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    """Common interface: encode, decode, token_bytes, special tokens, BOS handling."""

    bos_id: int | None = None
    add_bos: bool = False  # does the checkpoint's tokenizer prepend BOS to every encoding?
    special: dict[str, int] = {}
    vocab_size: int = 0

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text become their ids (as in HF)."""
        ids = self._encode(text)
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError


class TiktokenTokenizer(Tokenizer):
    def __init__(self, name, ranks: dict[bytes, int], pattern: str, special: dict[str, int], nfc=False):
        import tiktoken

        self.vocab_size = max(list(ranks.values()) + list(special.values())) + 1
        # tiktoken needs all 256 single bytes; a vocabulary trained on a smaller alphabet lacks some.
        # They get placeholder ranks past the vocabulary and are dropped after encoding, as HF's BPE
        # drops a byte it has no token for (no unk token).
        absent = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
        ranks = {**ranks, **{b: self.vocab_size + k for k, b in enumerate(absent)}}
        try:
            self.enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        except ValueError as e:  # e.g. a pre-tokenizer regex tiktoken cannot compile
            raise KvminiError(f"cannot build the tokenizer {name}: {e}") from None
        self.special, self.nfc = special, nfc

    def _encode(self, text):
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        return [i for i in self.enc.encode(text, allowed_special="all") if i < self.vocab_size]

    def token_bytes(self, i):
        if i >= self.vocab_size:  # one of the placeholder byte ranks, or past them: no text of the vocabulary
            return "\ufffd".encode()
        try:
            return self.enc.decode_single_token_bytes(i)
        except KeyError:  # an id the vocabulary skips
            return "\ufffd".encode()


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.add_bos = True
        self.special = {self.sp.id_to_piece(i): i for i in range(self.vocab_size) if self.sp.is_control(i)}

    def _encode(self, text):
        """Special-token strings split the text; each piece is encoded by sentencepiece."""
        ids, rest = [], text
        while rest:
            hits = [(rest.find(s), s) for s in self.special if s and s in rest]
            if not hits:
                ids += self.sp.encode(rest)
                break
            at, s = min(hits)
            if at:
                ids += self.sp.encode(rest[:at])
            ids.append(self.special[s])
            rest = rest[at + len(s):]
        return ids

    def token_bytes(self, i):
        if self.sp.is_byte(i):
            return bytes([int(self.sp.id_to_piece(i)[1:-1], 16)])  # '<0xE2>' -> b'\xe2'
        if self.sp.is_control(i):
            return self.sp.id_to_piece(i).encode()
        if self.sp.is_unknown(i):
            return "\ufffd".encode()
        return self.sp.id_to_piece(i).replace("\u2581", " ").encode()


# every printable ASCII character, white space and a few beyond: a split pattern must cut all of them into
# non-empty pieces (tiktoken drops what no piece covers, and stops the process on an empty piece)
PROBE = "".join(map(chr, range(32, 127))) + " \t\n\r\n  Àé ß ñ 中文 ١٢ 🙂 it's 2024."


def _checked_pattern(pattern, path: Path) -> str:
    """A pre_tokenizer's Split regex that compiles, and whose pieces of PROBE are non-empty and cover it."""
    if not isinstance(pattern, str) or not pattern:
        raise KvminiError(f"broken tokenizer.json {path}: the pre_tokenizer's Split pattern must be a non-empty regex")
    try:
        pieces = [m.group() for m in regex.finditer(pattern, PROBE)]
    except regex.error as e:
        raise KvminiError(f"broken tokenizer.json {path}: the pre_tokenizer's Split pattern does not compile ({e})") from None
    if "" in pieces or "".join(pieces) != PROBE:
        raise KvminiError(f"unsupported tokenizer.json {path}: its Split pattern {pattern!r} "
                          f"{'matches an empty piece' if '' in pieces else 'leaves some characters out of every piece'}; "
                          "kvmini supports patterns that cut a text into non-empty pieces covering all of it")
    return pattern


def _pattern_from_pre_tokenizer(pre: dict | None) -> str:
    steps = pre["pretokenizers"] if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s["type"] for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return DIGITS_GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) and "Regex" in steps[0]["pattern"]:
        return steps[0]["pattern"]["Regex"]  # checked by _checked_pattern
    raise KvminiError(f"unsupported tokenizer.json pre_tokenizer: {' + '.join(kinds) or 'none'}")


def load_tokenizer_json(path: Path) -> TiktokenTokenizer:
    """Byte-level BPE tokenizer.json -> tiktoken: rank of a token = its id (= its merge order)."""
    try:
        spec = json.loads(not_special(path, "tokenizer file").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvminiError(f"broken tokenizer.json {path}: {e}") from None
    try:
        return _from_spec(spec, path)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a field of an unexpected shape
        raise KvminiError(f"broken tokenizer.json {path}: unexpected structure ({type(e).__name__}: {e})") from None


def _from_spec(spec, path: Path) -> TiktokenTokenizer:
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise KvminiError(f"broken tokenizer.json {path}: it needs an object \"model\" with an object \"vocab\"")
    if model.get("type") != "BPE":
        raise KvminiError(f"unsupported tokenizer.json model type {model.get('type')!r} (only byte-level BPE)")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise KvminiError(f"unsupported tokenizer.json normalizer {normalizer!r}")
    pattern = _checked_pattern(_pattern_from_pre_tokenizer(spec.get("pre_tokenizer")), path)
    added = spec.get("added_tokens") or []
    if not isinstance(added, list) or not all(
        isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"] and _is_id(t.get("id")) for t in added
    ):
        raise KvminiError(f"broken tokenizer.json {path}: every added_tokens entry needs a non-empty string content "
                          "and an id")
    special = {t["content"]: t["id"] for t in added}
    vocab = model["vocab"]
    if not all(_is_id(i) for i in vocab.values()) or len(set(vocab.values())) != len(vocab):
        raise KvminiError(f"broken tokenizer.json {path}: vocab must map each token to its own id (an integer >= 0)")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for token, i in vocab.items():
        if token not in special:
            if not token or any(c not in byte_of for c in token):
                raise KvminiError(f"tokenizer.json token {token!r} (id {i}) is not written in the byte-level alphabet")
            ranks[bytes(byte_of[c] for c in token)] = i
    merges = model.get("merges", [])
    if not isinstance(merges, list) or not all(
        (isinstance(m, str) and " " in m) or (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m))
        for m in merges
    ):
        raise KvminiError(f"broken tokenizer.json {path}: merges must be \"a b\" strings or [a, b] pairs")
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    merged = [vocab.get(a + b) for a, b in merges]
    if any(i is None for i in merged) or any(x >= y for x, y in zip(merged, merged[1:])):
        raise KvminiError("tokenizer.json merges are not in token-id order; cannot map them to tiktoken ranks")
    tok = TiktokenTokenizer(path.parent.name, ranks, pattern, special, nfc=normalizer == "NFC")
    post = spec.get("post_processor") or {}
    single = (post.get("single") or [{}])[0] if post.get("type") == "TemplateProcessing" else {}
    first = single.get("SpecialToken", {}).get("id")  # TemplateProcessing "<bos> $A" adds BOS
    tok.add_bos, tok.bos_id = first is not None, special.get(first)
    return tok


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31  # (tiktoken keeps ids in 32 bits)


def load_tiktoken_model(path: Path) -> TiktokenTokenizer:
    """Meta's Llama-3 tokenizer.model: lines of 'base64(token bytes) rank'."""
    ranks = {}
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (UnicodeDecodeError, ValueError) as e:  # binascii.Error is a ValueError
        raise KvminiError(f"broken tiktoken file {path}: each line must be 'base64 rank' ({e})") from None
    special = {s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIALS)}
    tok = TiktokenTokenizer("llama3", ranks, LLAMA3_PATTERN, special)
    tok.bos_id, tok.add_bos = special["<|begin_of_text|>"], True
    return tok


def _is_tiktoken_file(path: Path) -> bool:
    head = path.read_bytes()[:256].split(b"\n", 1)[0].split()
    try:
        return len(head) == 2 and bool(base64.b64decode(head[0], validate=True)) and head[1].isdigit()
    except ValueError:
        return False


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder: tokenizer.json preferred, else tokenizer.model."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        tok = load_tokenizer_json(folder / "tokenizer.json")
    elif (folder / "tokenizer.model").exists():
        path = not_special(folder / "tokenizer.model", "tokenizer file")
        if _is_tiktoken_file(path):
            tok = load_tiktoken_model(path)
        else:
            try:
                tok = SentencePieceTokenizer(path)
            except (RuntimeError, OSError) as e:
                raise KvminiError(f"cannot read sentencepiece model {path}: {e}") from None
    else:
        raise KvminiError(f"no tokenizer.json or tokenizer.model in {folder}")
    bos = read_json_object(folder / "tokenizer_config.json").get("add_bos_token")
    if isinstance(bos, bool):
        tok.add_bos = bos and tok.bos_id is not None
    return tok


def read_json_object(path: Path) -> dict:
    """A checkpoint's optional JSON settings file ({} when absent); broken ones are refused."""
    if not path.exists():
        return {}
    try:
        value = json.loads(not_special(path, "settings file").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvminiError(f"broken {path.name} {path}: {e}") from None
    if not isinstance(value, dict):
        raise KvminiError(f"broken {path.name} {path}: it must hold a JSON object")
    return value


class StreamDecoder:
    """Turns ids into text as they arrive, holding back bytes of a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, i: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(i))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
