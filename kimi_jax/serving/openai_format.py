"""The OpenAI wire format, as this server speaks it: the request bodies it accepts (pydantic, strict) and the
response objects it answers with (choices, stream events, logprobs, usage, errors).

What each field means to the engine is the server's (``kimi_jax.serving.server``); the ranges are
``kimi_jax.fields``'s. Here: which fields exist, their JSON types, and the shapes of what goes back.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kimi_jax import fields
from kimi_jax.serving.batcher import Failed
from kimi_jax.serving.tools import ChatTemplateKwargs, MessageToolCall, Tool, ToolChoice

# OpenAI request fields this server does not implement, with the values that ask for nothing (besides null):
# any other value is a 400 that names the field. Fields that only identify the caller are accepted as they are.
# (`tools` and `tool_choice` are chat fields: here they only keep a completion request from asking for them.
# `parallel_tool_calls: false` would need the reply's grammar to allow one call: not wired to it yet.)
NOT_IMPLEMENTED: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "store": (False,),
    "service_tier": ("auto", "default"), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (), "parallel_tool_calls": (True,),
}
IDENTIFYING = ("user", "metadata", "safety_identifier", "prompt_cache_key")
# pydantic names the member of a union that failed in an error's location (str, list[str], literal[...], a model's
# class name); the field path a client sees leaves them out. Field names are snake_case, so none matches.
UNION_BRANCH = re.compile(r"str|int|float|bool|none|(list|dict|literal|function-\w+)\[.*\]|[A-Z]\w*")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)    # extras are checked against NOT_IMPLEMENTED
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)     # null: OpenAI's default, 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    # the logits processors (kimi_jax.decoding.processors; ranges in kimi_jax.fields): OpenAI's, and vLLM's
    # top_k, min_p and repetition_penalty where OpenAI has none
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # structured output (kimi_jax.text.grammar): OpenAI's response_format, and vLLM's guided_regex
    response_format: dict | None = None
    guided_regex: str | None = None
    stop_token_ids: list[int] | None = None         # vLLM's: token ids that end the reply as eos does
    method: Literal["ar", "dflash", "ddtree"] | None = None
    budget: int | Literal["auto"] | None = None


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=fields.LOGPROBS_MAX)    # the top alternatives per token


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None        # assistant only (tools.check_messages)
    tool_call_id: str | None = None                        # tool only, and required there
    reasoning_content: str | None = None                   # assistant only; not rendered (K2 drops old thoughts)


class ChatRequest(Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=fields.LOGPROBS_MAX)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


def structured(body: Common, reply_regex: str | None = None) -> dict:
    """The request's structured output as ``Model.grammar`` takes it: a chat reply's regex (strict tools:
    ``tools.ToolPlan.reply_regex``, which holds the response format), else the response format and regex."""
    if reply_regex is not None:
        return {"reply_regex": reply_regex}
    given = {"response_format": body.response_format, "regex": body.guided_regex}
    return {k: v for k, v in given.items() if v is not None}


def processing(body: Common, reply_regex: str | None = None) -> dict:
    """The logits processors and structured output the request set, as the engine takes them (logit_bias keys:
    decimal strings)."""
    values = {name: getattr(body, name) for name in fields.PROCESSORS if getattr(body, name) is not None}
    values.update(structured(body, reply_regex))
    asked = getattr(body, "logprobs", None)     # completions: how many alternatives; chat: a bool + top_logprobs
    count = asked if not isinstance(asked, bool) else (body.top_logprobs or 0) if asked else None
    if count is not None:
        values["logprobs"] = count
    return values


# ---- responses ----------------------------------------------------------------------------------------------

def completion_shape(tok, i: int) -> dict:
    """A completion's pieces for choice ``i`` (``tok``: the tokenizer, for the logprobs' token texts): ``choice``
    (the whole choice at the end), ``deltas`` (a stream's choice events for a piece of text)."""
    return {
        "prefix": "cmpl", "object": "text_completion", "chunk": "text_completion",
        "choice": lambda text, reason, lps=None: {"index": i, "text": text, "finish_reason": reason,
                                                  "logprobs": completion_logprobs(tok, lps)},
        "deltas": lambda text, reason, lps=None: [{"index": i, "text": text, "finish_reason": reason,
                                                   "logprobs": completion_logprobs(tok, lps)}]
        if text or reason or lps else []}

def chat_shape(tok, reply_of):
    """-> ``shape(i)``: the chat response's pieces for choice i, as ``completion_shape``'s, plus ``first`` (the
    role event); each choice's own reply (``reply_of()``, a fresh parser) turns text into message fields and
    deltas."""
    def shape(i: int):
        reply = reply_of()

        def choice(text, reason, lps=None):
            reply.push(text)
            reply.end()
            return {"index": i, "message": reply.message(), "finish_reason": reply.finish_reason(reason),
                    "logprobs": chat_logprobs(tok, lps)}

        def deltas(text, reason, lps=None):
            out = [{"index": i, "delta": d, "finish_reason": None} for d in reply.push(text) + (
                reply.end() if reason else [])]
            if (reason or lps) and not out:
                out.append({"index": i, "delta": {}, "finish_reason": None})
            if lps:
                out[0]["logprobs"] = chat_logprobs(tok, lps)
            if reason:
                out[-1]["finish_reason"] = reply.finish_reason(reason)
            return out

        return {"prefix": "chatcmpl", "object": "chat.completion", "chunk": "chat.completion.chunk",
                "first": {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                "choice": choice, "deltas": deltas}
    return shape


def token_text(tok, token: int) -> tuple[str, list[int]]:
    raw = tok.decode_bytes([token])
    return raw.decode("utf-8", errors="replace"), list(raw)


def completion_logprobs(tok, lps) -> dict | None:
    """OpenAI's completions logprobs object (tokens, token_logprobs, top_logprobs, text_offset), or None."""
    if lps is None:
        return None
    return {"tokens": [token_text(tok, t)[0] for t, *_ in lps], "token_logprobs": [c for _, _, c, _ in lps],
            "top_logprobs": [{token_text(tok, t)[0]: v for t, v in top} for *_, top in lps],
            "text_offset": [offset for _, offset, _, _ in lps]}


def chat_logprobs(tok, lps) -> dict | None:
    """OpenAI's chat logprobs object ({"content": [{token, logprob, bytes, top_logprobs}]}), or None."""
    if lps is None:
        return None

    def entry(token, logprob):
        text, raw = token_text(tok, token)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return {"content": [{**entry(t, c), "top_logprobs": [entry(a, v) for a, v in top]} for t, _, c, top in lps],
            "refusal": None}


def usage(gens) -> dict:
    """One prompt, every choice's tokens (OpenAI counts n choices' completions together)."""
    prompt, tokens = gens[0].prompt_tokens, sum(g.tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens,
            "prompt_tokens_details": {"cached_tokens": gens[0].job.cached}}


def failure_body(failed: Failed, rid: str) -> dict:
    code = "shutting_down" if failed.status == 503 else "internal_error"
    return {"error": {"message": f"{failed.message} (request {rid})", "type": "server_error", "param": None,
                      "code": code}}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
