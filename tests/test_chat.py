"""Chat formatting equals HF's rendering of the family's Jinja chat template."""
import pytest

from kvmini.chat import ChatML, Llama2Chat, Llama3Chat, chat_format, load_chat_format

# Published templates (shortened to what is rendered for system/user turns).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}{% set content = "
    "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
    "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
    "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
QWEN25_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there,\nfriend "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}, {"role": "user", "content": "C"}],
]


def hf_render(template, messages, bos="<s>", eos="</s>"):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                        bos_token=bos, eos_token=eos)
    return rendered[0]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_template_equals_hf(default_model_dir, messages):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_dir)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_chat_format(default_model_dir).render(messages) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_qwen_chatml_with_default_system_equals_hf(messages):
    fmt = chat_format(QWEN25_TEMPLATE)
    assert isinstance(fmt, ChatML) and fmt.default_system.startswith("You are Qwen")
    assert fmt.render(messages) == hf_render(QWEN25_TEMPLATE, messages)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_llama3_equals_hf(messages):
    fmt = chat_format(LLAMA3_TEMPLATE)
    assert isinstance(fmt, Llama3Chat)
    assert fmt.render(messages) == hf_render(LLAMA3_TEMPLATE, messages, bos="<|begin_of_text|>")


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_llama2_equals_hf(messages):
    fmt = chat_format(LLAMA2_TEMPLATE)
    assert isinstance(fmt, Llama2Chat)
    assert fmt.render(messages) == hf_render(LLAMA2_TEMPLATE, messages)


def test_unknown_or_missing_template_gives_no_format():
    assert chat_format(None) is None
    assert chat_format("{{ messages[0]['content'] }}") is None
