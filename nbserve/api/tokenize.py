"""POST /tokenize and /detokenize, as vLLM and llama.cpp's server offer them: text or chat
messages (rendered by the model's template, as for serving) to token ids, and back. Both
servers' field names are read; the answer holds both servers' keys. The bodies' schemas, then
the routes."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..types import InvalidRequestError, TokenCodec
from ..types import Request as GenRequest
from .errors import APIError
from .handler import RouteContext
from .openapi_schemas import body_ref
from .protocol import Message, Tool, _Body, template_messages, thinking_switch
from .streams import JSONBody


class TokenizeRequest(_Body):
    prompt: str | None = None  # vLLM
    content: str | None = None  # llama.cpp
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: JSONBody | None = None
    add_special_tokens: bool | None = None  # vLLM
    add_special: bool | None = None  # llama.cpp
    return_token_strs: bool | None = None  # vLLM
    with_pieces: bool | None = None  # llama.cpp


class DetokenizeRequest(_Body):
    tokens: list[int]


def _text_of(body: TokenizeRequest) -> str | None:
    given = [x for x in (body.prompt, body.content) if x is not None]
    if len(given) + (body.messages is not None) != 1:
        raise InvalidRequestError("send exactly one of prompt (or content) and messages",
                                  param="prompt")
    return given[0] if given else None


def router(base: RouteContext) -> APIRouter:
    """POST /tokenize and /detokenize (no /v1 prefix, as vLLM and llama.cpp serve them)."""
    r = APIRouter()

    def tokenizer(ctx: RouteContext) -> TokenCodec:
        tok = ctx.backend.tokenizer  # per call: the backend may be swapped
        if tok is None:
            raise APIError(501, "this backend does not expose its tokenizer here",
                           "invalid_request_error", None, "unsupported")
        return tok

    @r.post("/tokenize", openapi_extra=body_ref(TokenizeRequest))
    async def tokenize(request: Request) -> JSONBody:
        body, _, ctx = await base.parse(request, TokenizeRequest)
        limits = ctx.limits
        text = _text_of(body)
        tok = tokenizer(ctx)
        specials = body.add_special_tokens if body.add_special_tokens is not None else \
            body.add_special
        if text is not None:
            limits.check_text("prompt", len(text), limits.max_conversation_chars, "The prompt")
            ids = tok.encode(text, add_special_tokens=True if specials is None else specials)
        else:
            req = GenRequest(messages=template_messages(body.messages or [], limits),
                             tools=[t.spec() for t in body.tools]
                             if body.tools else None,
                             add_generation_prompt=body.add_generation_prompt is not False,
                             template_kwargs=thinking_switch(None, body.chat_template_kwargs))
            rendered = ctx.backend.prompt_token_ids(req)
            if rendered is None:
                raise APIError(501, "this backend cannot render chat messages here",
                               "invalid_request_error", "messages", "unsupported")
            ids = rendered
        out: JSONBody = {"count": len(ids), "tokens": ids}
        max_context = ctx.backend.max_context
        if max_context:
            out["max_model_len"] = max_context
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        if body.with_pieces:  # llama.cpp's shape
            out["tokens"] = [{"id": i, "piece": tok.decode([i])} for i in ids]
        return out

    @r.post("/detokenize", openapi_extra=body_ref(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONBody:
        body, _, ctx = await base.parse(request, DetokenizeRequest)
        tok = tokenizer(ctx)
        vocab = tok.vocab_size or ctx.backend.vocab_size or 0
        bad = [t for t in body.tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab}), got {bad[0]}",
                                      param="tokens")
        text = tok.decode(body.tokens)
        return {"prompt": text, "content": text}

    return r
