"""POST /v1/rerank (also /rerank and /v2/rerank, as vLLM mounts it): the shape llama.cpp's
server and vLLM take (`query`, `documents`, `top_n`, `return_documents`; results with `index`
and `relevance_score`, best first), scored the way Qwen3-Reranker is.

Each document is one prefill-only engine request: the model's own chat template renders
Qwen3-Reranker's judge prompt (its system line, then "<Instruct>: …\\n<Query>: …\\n<Document>:
…" as the user turn, then the assistant turn opened with thinking off, `enable_thinking`
False), and the engine answers the logits of the tokenizer's single "no" and "yes" tokens at
the last position (`EmbedSpec.score_token_ids`). The relevance score is the softmax of those
two, the yes part. Any model with a chat template and single-token yes/no is scored so; the
scores mean something only for a model trained to answer that question (a yes/no reranker).
The prompts go to the engine as /v1/embeddings' inputs do (`embeddings.embed_texts`), so the
engine batches them with the rest of its work.
"""

from __future__ import annotations

import math

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..types import Backend, ChatMessage, EmbedSpec, InvalidRequestError, Request, TokenCodec
from .embeddings import embed_texts
from .handler import CLIENT_GONE, RouteContext, unless_disconnected
from .limits import Limits
from .openapi_schemas import body_ref
from .protocol import _Body, _Schema
from .streams import JSONBody

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# Qwen3-Reranker's prompt (its model card's format_instruction and system line)
JUDGE_SYSTEM = ("Judge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".")
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES, NO = "yes", "no"


class RerankDocument(_Schema):
    """A document given as an object (Cohere's and Jina's shape)."""

    text: str


class RerankRequest(_Body):
    """POST /v1/rerank. `instruction` is nbserve's extension (Qwen3-Reranker's `<Instruct>`;
    its default otherwise). `return_documents` defaults to true, as vLLM answers."""

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None

    def texts(self, limits: Limits) -> list[str]:
        """The documents' texts, checked against the limits (at least one, at most
        `max_prompts`, each with the query within `max_conversation_chars`)."""
        docs = [d if isinstance(d, str) else d.text for d in self.documents]
        if not docs:
            raise InvalidRequestError("documents must hold at least one document",
                                      param="documents")
        if len(docs) > limits.max_prompts:
            raise InvalidRequestError(
                f"documents holds {len(docs)} documents; the limit is {limits.max_prompts} "
                "(one engine request each): send fewer, or ask the server operator to raise "
                "Limits.max_prompts", param="documents")
        if self.top_n is not None and self.top_n < 1:
            raise InvalidRequestError(f"top_n must be at least 1, got {self.top_n}",
                                      param="top_n")
        head = len(self.query) + len(self.instruction or DEFAULT_INSTRUCTION)
        for i, doc in enumerate(docs):
            limits.check_text(f"documents[{i}]", head + len(doc), limits.max_conversation_chars,
                              f"The query with documents[{i}]")
        return docs


def yes_no_ids(tokenizer: TokenCodec | None) -> tuple[int, int]:
    """The (no, yes) token ids a reranker answers with; a 400 when the model has no single
    token for either (it is not a yes/no reranker)."""
    if tokenizer is None:
        raise InvalidRequestError("reranking needs the model's tokenizer, and this backend has "
                                  "none", param="model")
    ids = {word: tokenizer.encode(word, add_special_tokens=False) for word in (NO, YES)}
    split = {w: len(v) for w, v in ids.items() if len(v) != 1}
    if split:
        said = ", ".join(f"{w!r} is {n} tokens" for w, n in split.items())
        raise InvalidRequestError(
            f"this model is not a yes/no reranker: {said} in its vocabulary, and /v1/rerank "
            "scores a document by the probability of the single token 'yes' against 'no' "
            "(Qwen3-Reranker's way)", param="model")
    return ids[NO][0], ids[YES][0]


def judge_messages(query: str, document: str, instruction: str | None = None
                   ) -> list[ChatMessage]:
    """Qwen3-Reranker's judge prompt for one document, as chat messages."""
    user = (f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def judge_request(query: str, document: str, instruction: str | None) -> Request:
    """The judge prompt for one document, through the model's template with the answer opened
    and thinking off."""
    return Request(messages=judge_messages(query, document, instruction),
                   template_kwargs={"enable_thinking": False}, add_generation_prompt=True)


def judge_prompt(backend: Backend, query: str, document: str, instruction: str | None
                 ) -> list[int]:
    """The judge prompt's token ids as the backend serves them (its template applied)."""
    ids = backend.prompt_token_ids(judge_request(query, document, instruction))
    if ids is None:
        raise InvalidRequestError("reranking needs a backend that renders the model's chat "
                                  "template, and this one does not", param="model")
    return ids


def relevance(no_logit: float, yes_logit: float) -> float:
    """softmax((no, yes))[yes], computed without overflow."""
    d = no_logit - yes_logit
    if d > 0:
        e = math.exp(-d)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(d))


def ranked(scores: list[float], docs: list[str], top_n: int | None,
           return_documents: bool) -> list[JSONBody]:
    """The results, best first (ties by index), the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda k: (-scores[k], k))[:top_n]
    out: list[JSONBody] = []
    for k in order:
        item: JSONBody = {"index": k, "relevance_score": scores[k]}
        if return_documents:
            item["document"] = {"text": docs[k]}
        out.append(item)
    return out


def router(base: RouteContext) -> APIRouter:
    """POST /v1/rerank, /rerank and /v2/rerank: one JSON answer."""
    r = APIRouter()

    async def rerank(request: HTTPRequest) -> Response:
        body, rid, ctx = await base.parse(request, RerankRequest)
        docs = body.texts(ctx.limits)
        spec = EmbedSpec(score_token_ids=yes_no_ids(ctx.backend.tokenizer))
        prompts = [judge_prompt(ctx.backend, body.query, d, body.instruction) for d in docs]
        trace = ctx.begin(request, rid, {"query": body.query, "documents": docs})
        done = await unless_disconnected(request, embed_texts(ctx.backend, prompts, spec,
                                                              request_id=rid))
        if done is None:
            trace.disconnected = True
            return Response(status_code=CLIENT_GONE)
        logits, tokens = done
        trace.prompt_tokens = tokens
        trace.finish_reasons.append("stop")
        answer: JSONBody = {
            "id": f"rerank-{rid}", "model": ctx.backend.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": ranked([relevance(no, yes) for no, yes in logits], docs, body.top_n,
                              body.return_documents)}
        return JSONResponse(answer, headers={"X-Request-ID": rid})

    for path in RERANK_PATHS:
        r.add_api_route(path, rerank, methods=["POST"], openapi_extra=body_ref(RerankRequest),
                        include_in_schema=path == RERANK_PATHS[0])
    return r
