"""A checkpoint directory's tokenizer: `tokenizer.json` (via `tokenizers`) and the chat template in
`tokenizer_config.json` (Jinja, rendered the way transformers renders it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from moelaunch.text.files import check_readable, is_missing, read_text

Message = dict[str, Any]


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        template = config.get("chat_template")
        self._template_source = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None

    @staticmethod
    def check_files(path: str | Path) -> None:
        """The checkpoint's tokenizer files are there and readable: checked before the model loads."""
        file = Path(path) / "tokenizer.json"
        if is_missing(file):
            raise FileNotFoundError(f"{file} not found: the checkpoint directory needs a tokenizer.json")
        check_readable(file, "tokenizer")
        config_file = Path(path) / "tokenizer_config.json"
        if not is_missing(config_file):
            check_readable(config_file, "tokenizer config")

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        cls.check_files(path)
        path = Path(path)
        file = path / "tokenizer.json"
        config_file = path / "tokenizer_config.json"
        try:
            config = json.loads(read_text(config_file, "tokenizer config")) if config_file.exists() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tokenizer config {config_file}: not valid JSON ({e})") from None
        try:
            tokenizer = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a bad file
            raise ValueError(f"{file}: not a tokenizer the tokenizers library can read ({e})") from None
        try:
            return cls(tokenizer, config)
        except jinja2.TemplateError as e:
            raise ValueError(f"{config_file}: its chat_template does not compile ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def grammar_vocabulary(self) -> tuple[list[str], bool]:
        """Every id's token string as the model's vocabulary spells it, with added tokens (specials,
        think markers) as "" so a grammar never emits them; and whether the spelling is byte-level
        (GPT-2's printable stand-ins for bytes, as DeepSeek-V3's tokenizer has)."""
        added = self._tok.get_added_tokens_decoder()
        vocab = ["" if i in added else (self._tok.id_to_token(i) or "") for i in range(self.vocab_size)]
        return vocab, isinstance(self._tok.decoder, decoders.ByteLevel)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized, none is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """`variables`: more the template may use (tools, a template's own switches), as transformers
        passes them."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        return self._template.render(
            **variables,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self, messages: list[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **variables))

    def template_mentions(self, name: str) -> bool:
        """Whether the chat template uses `name` (e.g. tools): a template that does not, ignores it."""
        return self._template_source is not None and name in self._template_source


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
