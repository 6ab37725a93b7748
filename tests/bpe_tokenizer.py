"""A real Hugging Face tokenizer built locally for tests: no download.

:func:`build_tokenizer` trains a small byte-level BPE with the ``tokenizers`` library on a fixed multilingual
text (so some characters — CJK, emoji — are split across tokens and others merged), adds special tokens
that match the torch engine's tiny Llama (``<pad>`` 0, ``<s>`` 1 = BOS, ``</s>`` 2 = EOS) and chat role
markers, a post-processor that starts every encoded text with BOS (as Llama's does), and saves it with
``save_pretrained`` together with a chat template. Training is deterministic for the fixed corpus, so
every build has the same vocabulary and ids.

Import it as ``from bpe_tokenizer import build_tokenizer`` (``tests/`` is on ``sys.path``); the session
fixture ``bpe_tokenizer_dir`` (tests/conftest.py) builds it once per session.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SPECIAL_TOKENS", "build_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# The template refuses a conversation that starts with the assistant (a template error must be a 400).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('the conversation must not start with an assistant message') }}"
    "{% endif %}"
    "{{ bos_token }}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello, hilum: a scheduler that migrates running requests.",
    "Grüße aus Zürich, déjà vu, naïve café, smörgåsbord.",
    "你好世界，今天天气很好。",
    "こんにちは、世界。",
    "Emoji: 🙂 🎉 🚀 — and a snowman ☃.",
    "KV cache blocks move between instances while the request keeps decoding.",
    "Stop here. STOP. The end.",
]


def build_tokenizer(directory: Path, vocab_size: int = 400) -> Path:
    """Train, save and return ``directory`` (created if needed): a tokenizer ``AutoTokenizer`` loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    # completion prompts start with BOS, as Llama's tokenizer encodes them; chat templates write their own
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    hf.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(directory))
    return directory
