"""A checkpoint directory's tokenizer: `tokenizer.json` (via `tokenizers`) and the chat template in
`tokenizer_config.json` (Jinja, rendered the way transformers renders it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from moelaunch.text.content_spans import CONTENT_PARTS, Span, TemplateNotSplittable, split_rendered
from moelaunch.text.files import check_readable, is_missing, read_text

Message = dict[str, Any]


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self._text_only = _without_added_tokens(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        self._added = set(added)
        longest_first = sorted((t.content for t in added.values()), key=len, reverse=True)
        self._added_text = re.compile("|".join(map(re.escape, longest_first))) if added else None
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
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        special_tokens_in_content: bool = False,
        **variables: Any,
    ) -> list[int]:
        """Token ids of the rendered chat. Special and added tokens written inside a message's
        content (`<｜Assistant｜>`, `<think>`) are encoded as the text they spell, so a user cannot
        forge a turn, unless `special_tokens_in_content`. Content without such markup encodes as the
        whole rendered text does: the prompt is only ever cut at the template's own added tokens,
        where the tokenizer cuts it anyway."""

        def render(msgs: list[Message]) -> str:
            plain = [{k: v for k, v in m.items() if k != CONTENT_PARTS} for m in msgs]
            return self.apply_chat_template(plain, add_generation_prompt, **variables)

        if special_tokens_in_content or not any(self._spells_added_token(m.get("content")) for m in messages):
            return self.encode(render(messages))
        try:
            return self._encode_spans(split_rendered(messages, render))
        except TemplateNotSplittable as e:
            raise ValueError(
                f"{e}, and a message's content holds special-token markup: remove it, or set "
                "allow_special_tokens_in_content to read it as control tokens"
            ) from None

    def _encode_spans(self, spans: list[Span]) -> list[int]:
        """The template's spans with their added tokens as control ids, the content as text."""
        ids: list[int] = []
        text = ""  # plain text since the template's last added token: encoded in one piece
        for piece, from_content in spans:
            if from_content:
                text += piece
                continue
            encoding = self._tok.encode(piece, add_special_tokens=False)
            cut = 0
            for token, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
                if token in self._added:
                    ids += self._text_only.encode(text + piece[cut:begin], add_special_tokens=False).ids
                    ids.append(token)
                    text, cut = "", end
            text += piece[cut:]
        return ids + self._text_only.encode(text, add_special_tokens=False).ids

    def _spells_added_token(self, content: Any) -> bool:
        return (
            isinstance(content, str)
            and self._added_text is not None
            and bool(self._added_text.search(content))
        )

    def template_mentions(self, name: str) -> bool:
        """Whether the chat template uses `name` (e.g. tools): a template that does not, ignores it."""
        return self._template_source is not None and name in self._template_source


def _without_added_tokens(tokenizer: HFTokenizer) -> HFTokenizer:
    """A copy that knows no added tokens, so `<｜Assistant｜>` in its input is encoded as the text it
    spells. Not `encode_special_tokens`: DeepSeek's role markers are added tokens not marked special,
    which that switch leaves alone. A copy, not a toggle: the server encodes from many threads."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return HFTokenizer.from_str(json.dumps(spec))


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
