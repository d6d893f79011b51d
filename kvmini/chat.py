"""Chat formats: a conversation -> the exact prompt text the model was fine-tuned on.

Three small classes cover the supported families; `chat_format` picks one from the
checkpoint's Jinja chat template by its marker tokens (we never execute the template).

    ChatML([{"role": "user", "content": "Hi"}]) ->
    "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
"""
import re
from pathlib import Path

from kvmini.errors import KvminiError
from kvmini.files import not_special


class ChatML:
    """Qwen2/3, SmolLM2. Some templates add a default system message when none is given."""

    stop = ("<|im_end|>", "<|endoftext|>")

    def __init__(self, default_system: str | None = None):
        self.default_system = default_system

    def render(self, messages: list[dict]) -> str:
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}] + messages
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n"


class Llama3Chat:
    """Llama-3 instruct: header tokens around each role, <|eot_id|> ends a turn."""

    stop = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")

    def render(self, messages: list[dict]) -> str:
        text = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages
        )
        return text + "<|start_header_id|>assistant<|end_header_id|>\n\n"


class Llama2Chat:
    """Llama-2 chat and Mistral instruct: [INST] ... [/INST], system prompt in <<SYS>> (Llama-2)."""

    stop = ("</s>",)

    def render(self, messages: list[dict]) -> str:
        system = None
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        text = ""
        for i, m in enumerate(messages):
            content = m["content"]
            if i == 0 and system is not None:
                content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
            if m["role"] == "user":
                text += f"<s>[INST] {content.strip()} [/INST]"
            else:
                text += f" {content.strip()} </s>"
        return text


def chat_format(template: str | None):
    """The chat format of a Jinja template, or None if it is absent or not recognised."""
    if not template:
        return None
    if "<|im_start|>" in template:
        m = re.search(r"<\|im_start\|>system\\n(.*?)<\|im_end\|>", template.replace("\n", "\\n"))
        default = m.group(1).replace("\\n", "\n") if m and "{{" not in m.group(1) else None
        return ChatML(default)
    if "<|start_header_id|>" in template:
        return Llama3Chat()
    if "[INST]" in template:
        return Llama2Chat()
    return None


def stop_token_ids(eos_ids, tokenizer, chat) -> set[int]:
    """Token ids that end an answer: the model's EOS ids plus the chat format's end-of-turn tokens."""
    return set(eos_ids) | {tokenizer.special[s] for s in (chat.stop if chat else ()) if s in tokenizer.special}


def load_chat_format(folder: str | Path):
    """The chat format of a checkpoint folder (chat_template.jinja, else tokenizer_config.json).

    tokenizer_config.json may hold one template, or HF's list of named ones
    ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]): then the "default" one is used.
    """
    from kvmini.tokenizer import read_json_object

    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        try:
            return chat_format(not_special(jinja, "chat template").read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise KvminiError(f"{jinja} is not UTF-8 text (byte {e.start})") from None
    template = read_json_object(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise KvminiError(f"tokenizer_config.json lists chat templates {sorted(map(str, named))} but none named "
                              "'default'; pass --raw to skip the chat template")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise KvminiError("tokenizer_config.json: chat_template must be a string or a list of named templates")
    return chat_format(template)
