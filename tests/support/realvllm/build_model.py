"""Build the tiny model the real vLLM server serves, locally and deterministically, in seconds.

    .venv-vllm/bin/python -m tests.support.realvllm.build_model [DIR]

A byte-level BPE tokenizer trained with `tokenizers` on the text below and on the recorded Claude
Code request (tests/fixtures/), wrapped as a `PreTrainedTokenizerFast` with a Jinja chat
template, and a randomly initialised `LlamaForCausalLM` (hidden 128, 4 heads, 2 layers: vLLM's
CPU attention needs head_dim >= 32) with a 65,536-token window: Claude Code's first request is
~21k tokens for this tokenizer (prefilled in ~3 s here) and asks for up to 32,000 more. The
weights are random, so the text it generates is junk; what the tests need is a real engine: real
tokenization, chat templating, scheduling, streaming, usage and errors. Two changes make it
predictable: its special tokens are never generated (zero output rows) and greedy decoding is its
default (generation_config `top_k=1`), so every answer runs to `max_tokens`, the same every time.
Nothing is fetched from a model hub. Runs in the engine's virtualenv (it has torch, transformers
and tokenizers).

The chat template renders tools and tool calls the way the `hermes` tool-call parser reads them
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`); both markers are added tokens, which
that parser requires of the vocabulary.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# Offline before transformers is imported: it reads these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if __package__ in (None, ""):  # run as a file: make `tests.support.realvllm` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.support.realvllm.paths import CLAUDE_CODE_REQUEST, MAX_MODEL_LEN, MODEL_DIR, MODEL_STAMP

BOS, EOS = "<|begin|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>"]
VOCAB_SIZE = 8192
SEED = 1234

# String-only content: vLLM then joins a message's text parts before rendering.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>You may call these tools: {{ tools | tojson }}<|end|>{% endif -%}"
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>"
    "{%- if message['content'] %}{{ message['content'] }}{% endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{%- endfor -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)

# A few KB of text in the register the tests speak (English prose, JSON, code) to train on.
CORPUS = [
    "The gateway streams tokens from the model through the cluster, and every answer arrives in order.",
    "Hello world. Be brief. What is the weather in Paris today? Say hello to the user and stop.",
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
    "def handler(request):\n    return {'status': 200, 'body': request.json()}\n",
    "Prefill builds the KV cache of the prompt; decode generates one token at a time from it.",
    "You are Claude Code, a command line tool. Read the file, edit the code, run the tests again.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14 -1 +1 = < > ( ) [ ] { } , . ; : ! ? ' \" / \\ | _ - * & ^ % $ # @",
    "café naïve résumé 日本 🌍 — unicode travels as bytes and comes back whole.",
]


def claude_code_text() -> list[str]:
    """Every string in the recorded Claude Code request (tests/fixtures/), as training text."""
    import json

    strings: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            strings.extend(value)
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(json.loads(CLAUDE_CODE_REQUEST.read_text()))
    return strings


def train_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeated so that the merges of common words reach min_frequency; with Claude Code's own
    # request (system prompt, tools) so its text takes English-like token counts, as a real
    # tokenizer gives it: Claude Code's ~80 KB first request must fit the window and prefill in
    # seconds.
    tokenizer.train_from_iterator(CORPUS * 8 + claude_code_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<|pad|>",
        model_max_length=MAX_MODEL_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def build(target: Path = MODEL_DIR) -> Path:
    """Write the tokenizer and a random model to `target` (replaced whole: never half-built)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer()
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),  # type: ignore[attr-defined]
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),  # type: ignore[attr-defined]
        pad_token_id=tokenizer.convert_tokens_to_ids("<|pad|>"),  # type: ignore[attr-defined]
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    # It speaks plain text until max_tokens: the special tokens' output rows are zero, so their
    # logit is 0 while the largest of the ~3,000 random others is always above it, and greedy
    # decoding (made the default below) never picks one. A random model that could stop at any
    # token, or open a `<tool_call>` the tool parser then swallows, would make answers' lengths
    # luck; the tests need long answers (a client hanging up mid-stream) and short ones alike.
    with torch.no_grad():
        for token in SPECIAL_TOKENS:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 0  # type: ignore[attr-defined]
    # vLLM takes a request's unset sampling parameters from here: top_k=1 makes every request
    # that does not set top_k (Claude Code's, at temperature 1) greedy, hence reproducible.
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1
    staging = target.with_name(target.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
    (staging / MODEL_STAMP.name).write_text("built by tests/support/realvllm/build_model.py\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


if __name__ == "__main__":
    out = build(Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL_DIR)
    print(f"built {out}")
