"""Text in and out: tokenizer.json through `tokenizers`, and the checkpoint's prompt format: its own chat template
(tokenizer_config.json, or chat_template.jinja) rendered with jinja2 in the environment transformers gives it
(trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception, strftime_now), or, for a family whose release
builds prompts in code (DeepSeek-V4: config.json's model_type names it), that code's format (its entry's prompt_format:
runtime/models/families.py). Tools and an agent's history reach the prompt through either: the model's tool format
(tool_format.py) is V4's for that family, else the one its template writes calls in; a template that does not
describe the tools itself gets the format's description after the system prompt."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dsfp4.errors import ConfigError, ManifestError
from dsfp4.layout.tokenizer_config import NAME as TOKENIZER_CONFIG
from dsfp4.layout.tokenizer_config import read_tokenizer_config
from dsfp4.runtime.generate.answer.tool_format import TOOL_FORMATS, V4, template_tool_format
from dsfp4.runtime.generate.chat_messages import check_rendered
from dsfp4.runtime.generate.reasoning import THINK_END
from dsfp4.runtime.models.families import model_family


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _template_source(model_dir: Path, cfg: dict) -> str | None:
    """The chat template: a string, or the "default" entry of a list of named templates."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None


# the chat-template variable that switches thinking (DeepSeek-V3.1's), the one transformers gives the tools in,
# and the message field of an assistant's reasoning
THINKING, TOOLS, REASONING = "thinking", "tools", "reasoning_content"


def _model_type(model_dir: Path) -> str | None:
    """config.json's model_type, which names the family (None without a readable config.json)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """The conversation with `text` after the last system message's (a system message of it first if none): where
    a template that does not describe the tools gets the format's description (the last system message survives
    in every DeepSeek template; some keep only it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "system"), default=None)
    if last is None:
        return [{"role": "system", "content": text}, *messages]
    return [*messages[:last], {**messages[last], "content": messages[last]["content"] + text}, *messages[last + 1 :]]


def clean_text(text: str) -> str:
    """Text as tokenizers accepts it: lone surrogates (Python's stand-ins for undecodable bytes of argv or a
    terminal) become U+FFFD; valid text passes unchanged."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class ChatTokenizer:
    def __init__(self, model_dir: Path, eos_token_ids: tuple[int, ...] = ()):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} not found: copy the source checkpoint's tokenizer.json next to manifest.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            # tokenizers raises plain Exception for a malformed file
            raise ManifestError(f"{path}: not a valid tokenizer.json ({e}); copy it again from the source") from e
        # token -> its text decoded alone (decode_alone)
        self.alone: dict[int, str] = {}
        cfg_path = model_dir / TOKENIZER_CONFIG
        cfg = read_tokenizer_config(cfg_path)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # tokenizer_config.json's add_bos_token and add_eos_token, as transformers' Llama tokenizers (DeepSeek's
        # class) and vLLM apply them: where set they decide, whatever tokenizer.json's post-processor adds
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        switches = {key: cfg.get(f"add_{key}_token") for key in ("bos", "eos")}
        self.switched = any(isinstance(v, bool) for v in switches.values())
        # what the post-processor puts around text
        post = self.tok.encode("", add_special_tokens=True).ids
        self.add_bos = switches["bos"] if isinstance(switches["bos"], bool) else post[:1] == [self.bos_id]
        default_eos = post[-1:] == [self.eos_id] and post != [self.bos_id]
        self.add_eos = switches["eos"] if isinstance(switches["eos"], bool) else default_eos
        self.eos_ids = frozenset(({self.eos_id} | set(eos_token_ids)) - {None})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        source = _template_source(model_dir, cfg)
        try:
            self.template = env.from_string(source) if source is not None else None
            names = meta.find_undeclared_variables(env.parse(source)) if source is not None else set()
        except TemplateError as e:
            raise ConfigError(f"{cfg_path}: the chat template does not compile ({e})") from e
        # the release's own format, over any template: (messages, thinking, add_generation_prompt, tools) -> prompt
        self.native = model_family(_model_type(model_dir)).prompt_format
        # whether the format turns thinking on and off
        self.thinking_switch = self.native is not None or THINKING in names
        # the format's tool calls (None: it has none); whether the template describes the tools itself (V3.1's and
        # V3/R1's release templates do not: the format's description goes after the system prompt)
        self.tool_format = TOOL_FORMATS[V4] if self.native is not None else template_tool_format(source)
        self.template_tools = TOOLS in names
        # whether an assistant's reasoning_content reaches the prompt
        self.keeps_reasoning = self.native is not None or REASONING in (source or "")

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids; `special` adds the BOS and EOS that tokenizer_config.json's add_bos_token and add_eos_token ask
        for (DeepSeek: the BOS), or where neither is set what tokenizer.json's post-processor adds."""
        text = clean_text(text)
        if not special or not self.switched:
            return self._encode(text, special)
        ids = self._encode(text, False)
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if self.add_eos and self.eos_id is not None else [])

    def _encode(self, text: str, special: bool) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): the server's event loop runs meanwhile
        return self.tok.encode_batch([text], add_special_tokens=special)[0].ids

    def marker_ids(self) -> dict[str, int]:
        """The tool format's markers and </think> that are single tokens here -> their ids (for its grammars)."""
        texts = (*(self.tool_format.tokens if self.tool_format else ()), THINK_END)
        return {t: i for t in texts if (i := self.tok.token_to_id(t)) is not None}

    def decode(self, ids: list[int], keep_special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=not keep_special)

    def decode_alone(self, token: int) -> str:
        """One token's text decoded alone (as decode([token])), kept once decoded: a TextStream needs its last
        folded token's at every step, and a batch steps many streams."""
        text = self.alone.get(token)
        if text is None:
            text = self.alone[token] = self.decode([token])
        return text

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as the model was trained to see it (the format writes the BOS itself). `thinking` turns
        the model's thinking on or off where the format has that switch (V4's thinking mode, V3.1's template
        variable); None leaves the format's default (off). `tools`: an OpenAI tools list (checked: tools.py), for
        a format with tool calls; messages may hold tool calls and results (chat_messages.py's shape)."""
        if thinking is not None and not self.thinking_switch:
            raise ConfigError(
                "this model's prompt format has no thinking switch (R1 always thinks, V3 never does); leave thinking "
                "unset"
            )
        if tools and self.tool_format is None:
            raise ConfigError("tools: this model's prompt format has no tool calls (its chat template writes none)")
        if self.native is not None:
            return self.native(messages, bool(thinking), add_generation_prompt, tools or None)
        if self.template is None:
            raise ConfigError("this model has no chat template (tokenizer_config.json); give the prompt with --raw")
        given = messages
        if tools and not self.template_tools:
            messages = with_system_text(messages, "\n\n" + self.tool_format.describe(tools))
        try:
            prompt = self.template.render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
                **({} if thinking is None else {THINKING: thinking}),
                **({TOOLS: tools} if tools and self.template_tools else {}),
            )
        except (TemplateError, TypeError) as e:
            raise ConfigError(f"the chat template refused the conversation: {e}") from e
        check_rendered(prompt, given, tools)
        return prompt

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, thinking, tools), special=False)

    def encode_prompt(
        self,
        prompt: str,
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """One user turn (with an optional system message, and tools) through the prompt format, or raw text."""
        if raw:
            return self.encode(prompt)
        head = [{"role": "system", "content": system}] if system else []
        return self.encode_chat([*head, {"role": "user", "content": prompt}], thinking=thinking, tools=tools)


class TextStream:
    """The text of a growing list of token ids, decoding only its tail: whole re-decoding at every token
    would be quadratic in the answer's length. Tokens whose text is complete (no unfinished UTF-8 character
    at the end) are folded into `text`; the window of tokens since the last fold is decoded together with
    the window before it, so decoders that treat a first token specially (a leading space) agree."""

    def __init__(self, tokenizer: ChatTokenizer):
        self.tok, self.ids = tokenizer, []
        self.text = ""  # of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: the last folded window, decoded again for context

    def add(self, token: int) -> str:
        """Append a token -> the whole text so far (with a trailing U+FFFD while a character is unfinished)."""
        self.ids.append(token)
        # mostly one token: the last one folded
        window = self.ids[self.prefix : self.read]
        head = self.tok.decode_alone(window[0]) if len(window) == 1 else self.tok.decode(window)
        full = self.tok.decode(self.ids[self.prefix :])
        # a decoder that rewrites across the window's edge: widen it to all
        if not full.startswith(head):
            self.text, self.prefix, self.read = "", 0, 0
            head, full = "", self.tok.decode(self.ids)
        new = full[len(head) :]
        # the last character is not complete yet: fold nothing
        if new.endswith("\ufffd"):
            return self.text + new
        self.text += new
        self.prefix, self.read = self.read, len(self.ids)
        return self.text
