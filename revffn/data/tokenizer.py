"""Tokenizer loading: the shipped byte-level BPE tokenizer, a local HF tokenizer directory or a Hub ID's
(from the Hugging Face cache, `models.hub`).

The shipped tokenizer (`SHIPPED_TOKENIZER`, built by `scripts/build_tokenizer.py`) has 2048 tokens
and these special tokens (`SPECIAL_TOKENS`, ids in order):

    0 <|pad|>        padding
    1 <|endoftext|>  bos: document boundary (never added automatically)
    2 <|end|>        eos: ends every chat turn, so a generated response stops on it
    3 <|system|>  4 <|user|>  5 <|assistant|>   role headers

`<|end|>` is the eos token (not `<|endoftext|>`) because it is what the model learns to emit after
an answer: `generate(..., eos_token_id=tokenizer.eos_token_id)` then stops at the end of a response.
The ids 0/1/2 match pad/bos/eos of the tiny model presets.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from revffn.errors import UserError, one_line
from revffn.models.hub import parse_hub_id, snapshot
from revffn.models.loading import config_presets, resolve_model_ref, stored_config
from revffn.models.presets import TINY_PRESETS

SHIPPED_TOKENIZER = str(Path(__file__).resolve().parent.parent / "assets" / "tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")  # what AutoTokenizer builds from; without one it makes up a tokenizer
PAD, BOS, EOS = "<|pad|>", "<|endoftext|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]

# Each turn is "<|role|>\n{content}<|end|>\n"; the generation prompt is "<|assistant|>\n". Tool use (transformers'
# `tools=` and an assistant turn's `tool_calls`, as `data.templates`' fallback renders them): the tools offered open
# the conversation as "<|tools|>\n{JSON}<|end|>\n", each call follows the content as
# "<tool_call>\n{"name", "arguments"}\n</tool_call>", and a tool's result is a "<|tool|>" turn.
CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|tools|>\\n' + (tools | tojson) + '<|end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '\\n' if message['content'] or not loop.first else '' }}"
    "{{ '<tool_call>\\n' + (call['function'] | tojson) + '\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def load_tokenizer(path: str | None = None, key: str = "tokenizer") -> PreTrainedTokenizerFast:
    """The shipped tokenizer (`path=None`), the one in local directory `path`, or a Hub ID's (`ORG/NAME`:
    its tokenizer files from the cache, downloaded unless offline).

    pad_token falls back to eos_token when the tokenizer has none (padding is masked anyway).
    """
    where = SHIPPED_TOKENIZER if path is None else str(Path(path).expanduser())
    if path is not None and not Path(where).is_dir() and parse_hub_id(path):
        where = snapshot(path, key, weights=False)
    if not Path(where).is_dir():
        raise UserError(f"{key}: directory {path!r} not found. Fix: give a local directory holding tokenizer.json "
                        f"(e.g. the model directory), or leave {key} unset for the shipped tokenizer.")
    if not any((Path(where) / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{key}: {where!r} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}). Fix: copy "
                        f"the model's tokenizer files there (tokenizer.save_pretrained), or set {key}: DIR to a "
                        "directory that holds them.")
    try:
        # trust_remote_code=False: AutoTokenizer reads config.json, and a revffn final/ names its own config
        # class there (`models.hf_remote`); without it transformers would ask on stdin whether to run it
        tok = AutoTokenizer.from_pretrained(where, config=_nested_revffn_config(where), local_files_only=True,
                                            trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a directory it cannot read
        raise UserError(f"{key}: cannot load a tokenizer from {where!r}: {type(e).__name__}: {one_line(e)} "
                        "Fix: point it at a directory written by save_pretrained (tokenizer.json, "
                        "tokenizer_config.json).") from None
    if tok.eos_token is None:
        raise UserError(f"{key}: the tokenizer in {where!r} has no eos_token. Fix: set \"eos_token\" in its "
                        "tokenizer_config.json to the token that ends a response.")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _nested_revffn_config(where: str):
    """The base config of a final/ written with a nested `revffn` config.json (before `models.hf_remote`
    wrote it flat), else None. AutoTokenizer reads config.json first; on that `model_type` it falls back to
    a bare config and warns "You are using a model of type `revffn` to instantiate a model of type ``"."""
    from revffn.models.hf_remote import RevFFNConfig

    config = Path(where) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == RevFFNConfig.model_type:
        return stored_config(where)
    return None


def model_tokenizer(model: str, tokenizer: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer training uses for `model`: `tokenizer` when set, else the model's own (its directory,
    `builtin:base`'s, a Hub ID's), else, for a tiny preset or a config-only geometry (random init), the shipped one."""
    if tokenizer:
        return load_tokenizer(tokenizer)
    random_init = model in TINY_PRESETS or model in config_presets()
    return load_tokenizer(None if random_init else resolve_model_ref(model, weights=False))
