"""The OpenAI request and response shapes the server speaks (the subset a decoder can honour, plus ``mirrorsd``).

Requests are pydantic models: a wrong type becomes a 400 naming the field, as OpenAI's API does. Fields OpenAI
defines that mirrorsd cannot honour (``logprobs``, penalties, tools, ...) are refused with a 400 when set to
anything but their neutral value, instead of being silently ignored; unknown fields are ignored (like vLLM).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class MirrorsdOptions(BaseModel):
    """The ``mirrorsd`` extension object: the decoding method and its options for this request (checked by the
    method registry, like ``mirrorsd generate``'s flags); omitted fields take the server's defaults."""

    model_config = ConfigDict(extra="allow")

    method: str | None = None

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


Stop = str | list[str] | None


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    # Numbers are strict, as the Python API's are: pydantic's lax mode took `true` for 1 and 4.0 for 4
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM's extension; -1 and 0 disable it
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**63)  # (larger ones wrapped round silently)
    stop: Stop = None
    n: int | None = 1  # (null: OpenAI's default, as for stream and vLLM's ignore_eos)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool | None = False  # vLLM's extension: decode past EOS up to max_tokens (load generators send it)
    mirrorsd: MirrorsdOptions | None = None
    # OpenAI fields mirrorsd does not implement: refused unless neutral
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None  # (OpenAI's older function calling)
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None  # (predicted outputs: mirrorsd's drafts are its own)
    # vLLM's extensions a client may send expecting them honoured
    min_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> None:
        neutral = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
                   "frequency_penalty": (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
                   "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
                   "tool_choice": (None, "none", "auto"), "functions": (None, []),
                   "function_call": (None, "none", "auto"), "prediction": (None,), "min_tokens": (None, 0),
                   "min_p": (None, 0), "repetition_penalty": (None, 1), "stop_token_ids": (None, []),
                   "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
                   "guided_grammar": (None,)}
        for name, values in neutral.items():
            if getattr(self, name) not in values:
                raise APIError(400, f"{name} is not supported by mirrorsd", param=name, code="unsupported_parameter")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format",
                           code="unsupported_parameter")
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one completion per request for now), got {self.n}", param="n",
                           code="unsupported_parameter")

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop takes at most 4 sequences, got {len(stops)}", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if self.tool_calls:  # (dropped, the turn would read as an empty answer)
            raise APIError(400, "assistant tool_calls are not supported by mirrorsd", param="messages",
                           code="unsupported_parameter")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {p.type for p in self.content} - {"text"}
        if kinds:
            raise APIError(400, f"only text content parts are supported, got {', '.join(sorted(kinds))}",
                           param="messages", code="unsupported_content")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default for text completions

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request for now, got {len(p)}", param="prompt")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # (as the chat route's)
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
