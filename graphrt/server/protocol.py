"""The OpenAI request bodies graphrt serves, as pydantic models, and their sampling parameters.

Fields are OpenAI's; graphrt's structured-output fields (``regex``, ``choice``, ``grammar``,
and vLLM's ``guided_*`` spellings) are extra fields. Unknown fields are refused, as OpenAI does,
so that a misspelt parameter never silently changes nothing. Fields of the API that graphrt does
not implement (penalties, logit bias, ``best_of`` > n, top log-probabilities) are accepted at
their neutral values and refused otherwise, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from graphrt.sampling_params import InvalidRequestError


class BadField(InvalidRequestError):
    """An invalid value of a named request field (HTTP 400 with ``param`` set)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted at their neutral values only
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def _wants_logprobs(self) -> bool | int:
        raise NotImplementedError

    def alternatives(self) -> int:
        """How many likeliest tokens to return beside each sampled one."""
        raise NotImplementedError

    def sampling(self) -> list[dict[str, Any]]:
        """One SamplingParams dict per choice (``n`` of them; seeds seed, seed + 1, ...)."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise BadField(name, f"{name}={getattr(self, name)!r} is not supported: graphrt applies no penalties")
        if self.logit_bias:
            raise BadField("logit_bias", "logit_bias is not supported: give none (or an empty object)")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options is only allowed with stream: true")
        values: dict[str, Any] = {"max_tokens": self._max_tokens(), "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.stop is not None:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        wants = self._wants_logprobs()
        if wants:
            values["logprobs"] = wants  # True, or k: the k likeliest tokens beside each sampled one
            if getattr(self, "echo", False):
                values["prompt_logprobs"] = 0  # the echoed prompt's tokens carry theirs
        values.update(self._constraint())
        return [{**values, "seed": None if self.seed is None else self.seed + i} for i in range(self.n)]

    def _constraint(self) -> dict[str, Any]:
        given = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise BadField("response_format", "response_format of type json_schema needs a json_schema object")
            given["response_format"] = {"json_schema": fmt.json_schema.schema_}
        for name, key, value in (
            ("regex", "regex", self.regex),
            ("choice", "choice", self.choice),
            ("grammar", "grammar", self.grammar),
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ):
            if value is not None:
                given[name] = {key: tuple(value) if key == "choice" else value}
        if len(given) > 1:
            raise BadField(
                sorted(given)[1], f"at most one structured-output constraint per request, got {sorted(given)}"
            )
        return next(iter(given.values()), {})


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadField("prompt", "the prompt is empty: give a string, token ids, or a list of them")
        return list(p)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _wants_logprobs(self) -> bool | int:
        if self.echo and self.logprobs is not None and self.stream:
            raise BadField("echo", "echo with logprobs is served without streaming only (stream: false)")
        if self.best_of not in (None, self.n):
            raise BadField("best_of", f"best_of={self.best_of} is not supported: leave it unset or equal to n")
        if self.suffix:
            raise BadField("suffix", "suffix is not supported")
        return False if self.logprobs is None else (self.logprobs or True)

    def alternatives(self) -> int:
        return self.logprobs or 0


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadField(
                    f"messages[{index}].content[{j}]",
                    f"content part of type {part.get('type')!r} is not supported: this server takes text only",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _wants_logprobs(self) -> bool | int:
        if self.top_logprobs and not self.logprobs:
            raise BadField("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs: true")
        return (self.top_logprobs or True) if self.logprobs else False

    def alternatives(self) -> int:
        return self.top_logprobs or 0
