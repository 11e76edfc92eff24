"""Grammar-constrained decoding with llguidance: a `Constraint` or a tool-call grammar becomes a
matcher per choice, whose token mask is applied to that row's logits before sampling.

`Grammars` (one per tokenizer, shared by an engine's replicas) holds the tokenizer's grammar
data, which takes a while to build, and a small cache of compiled grammars: a request copies a
compiled matcher instead of compiling again (n > 1, and the same schema request after request).
`MaskJob` computes a batch's masks on a worker thread while the model runs; `apply_masks_`
puts them on the logits.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..text.json_bounds import bounded_numbers
from ..text.reasoning import ThoughtRule
from ..text.tokenizer import TokenizerProtocol
from ..text.tool_calls import HERMES, JSON_STYLE, ToolFormat, closed_schema, function_of
from ..types import Constraint, InvalidRequestError, JSONObject, JSONValue, Request
from .thoughts import after_thought

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

log = logging.getLogger("nbserve.engine")

_CACHED_GRAMMARS = 64


def _llg() -> ModuleType:
    try:
        import llguidance
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise InvalidRequestError(
            "constrained decoding (response_format, tool_choice, structured_outputs) needs the "
            "llguidance package: pip install llguidance", "response_format") from exc
    return llguidance


def _with_style(schema: JSONValue, strict: bool) -> JSONObject:
    """The schema as nbserve's grammars enforce it: the JSON style, closed objects, bounded
    numbers (json_bounds.py)."""
    styled = bounded_numbers(closed_schema(schema))
    if not isinstance(styled, dict):  # Constraint.check lets only an object through
        raise InvalidRequestError("a JSON schema must be an object", "response_format")
    own = styled.get("x-guidance", {})
    if not isinstance(own, dict):
        raise InvalidRequestError(f"x-guidance must be an object, got {own!r}",
                                  "response_format")
    return {**styled, "x-guidance": {**JSON_STYLE, **own, "lenient": not strict}}


def _text_of(c: Constraint) -> str:
    """A regex or grammar constraint's text (Constraint.check lets only a string through)."""
    if not isinstance(c.value, str):
        raise InvalidRequestError(f"{c.param}: a {c.kind} constraint takes a string", c.param)
    return c.value


def _choices_of(c: Constraint) -> list[JSONValue]:
    """A choice constraint's strings (Constraint.check lets only a list of them through)."""
    if not isinstance(c.value, list):
        raise InvalidRequestError(f"{c.param}: a choice constraint takes a list", c.param)
    return c.value


def lark_expression(c: Constraint) -> str:
    """The constraint as one Lark expression (for a tool grammar's text answer)."""
    if c.kind == "json_schema":
        return "%json " + json.dumps(_with_style(c.value, c.strict), ensure_ascii=False)
    if c.kind == "json_object":
        return "%json " + json.dumps(_with_style({"type": "object"}, True))
    if c.kind == "regex":
        return "/" + _text_of(c).replace("/", "\\/") + "/"
    if c.kind == "choice":
        return "(" + " | ".join(json.dumps(x, ensure_ascii=False) for x in _choices_of(c)) + ")"
    raise InvalidRequestError(f"{c.param}: a {c.kind} constraint cannot be combined with tools; "
                              "use a JSON schema, a regex or a choice", c.param)


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint."""
    llg = _llg()
    if c.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(_with_style(c.value, c.strict))
    if c.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(_with_style({"type": "object"}, True))
    if c.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(_text_of(c))
    if c.kind == "grammar":
        return llg.LLMatcher.grammar_from_lark(_text_of(c))
    return llg.LLMatcher.grammar_from_lark(f"start: {lark_expression(c)}\n")


class Grammars:
    """The grammar data of one tokenizer and its compiled grammars. Thread-safe."""

    def __init__(self, tokenizer: TokenizerProtocol, vocab_size: int, stop_ids: Sequence[int]):
        llg = _llg()
        self.vocab_size = vocab_size
        eos = list(stop_ids) or list(tokenizer.eos_token_ids)
        # llguidance reads each token's bytes (the ones logprobs report) and tokenizes through
        # nbserve's tokenizer: a third of the memory of handing it the tokenizer.json, which it
        # would load into a tokenizer of its own
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size,
                                                                           eos)),
                                         n_vocab=vocab_size, eos_token=eos)
        added = tokenizer.added_tokens
        self._specials = {added.get(i): i for i in tokenizer.special_ids}
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._executor: LLExecutor | None = None

    def special_id(self, marker: str) -> int | None:
        """The id of the special token spelled `marker`, if there is one."""
        return self._specials.get(marker)

    def matcher(self, grammar: str, param: str) -> LLMatcher:
        """A fresh matcher for `grammar`, copied from the compiled one; InvalidRequestError
        (naming `param`) when llguidance cannot compile it."""
        with self._lock:
            base = self._compiled.get(grammar)
            if base is not None:
                self._compiled.move_to_end(grammar)
        if base is None:
            llg = _llg()
            base = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if base.is_error():
                raise InvalidRequestError(f"{param}: nbserve cannot enforce this: "
                                          f"{base.get_error()}", param)
            with self._lock:
                self._compiled[grammar] = base
                while len(self._compiled) > _CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return base.deep_copy()

    def for_request(self, request: Request, fmt: ToolFormat | None,
                    thought: ThoughtRule = "none") -> str | None:
        """The grammar of a request (its tools and its constraint), or None when it has
        neither; it applies after the thought that `thought` allows. Strict tools' parameter
        schemas are checked on their own first, so that a keyword they cannot have enforced
        gets a 400 that names the tool."""
        grammar = self._request_grammar(request, fmt)
        return None if grammar is None else after_thought(grammar, thought, self.special_id)

    def _request_grammar(self, request: Request, fmt: ToolFormat | None) -> str | None:
        c = request.params.constraint
        if request.tools:
            fmt = fmt or HERMES
            names = {function_of(t).get("name") for t in request.tools}
            if request.tool_name is not None and request.tool_name not in names:
                raise InvalidRequestError(
                    f"tool_choice names the function {request.tool_name!r}, which is not in "
                    f"tools ({', '.join(sorted(str(n) for n in names))})", "tool_choice")
            for i, tool in enumerate(request.tools):
                fn = function_of(tool)
                if fn.get("strict") and fn.get("parameters"):
                    self.matcher(grammar_text(Constraint("json_schema", fn["parameters"])),
                                 f"tools[{i}].function.parameters")
            answer = None if c is None else lark_expression(c)
            return fmt.grammar(request.tools, required=request.tool_choice == "required",
                               name=request.tool_name, parallel=request.parallel_tool_calls,
                               answer=answer, special=self.special_id)
        return None if c is None else grammar_text(c)

    def accepts(self, start: LLMatcher, text: str) -> bool:
        """Whether `text` is a whole answer of the grammar whose matcher `start` has consumed
        nothing (`start` is left as it is): a stop string or a stop token may end a
        constrained answer only there."""
        m = start.deep_copy()
        ids = self.tokenizer.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and bool(m.is_accepting())

    @property
    def executor(self) -> LLExecutor:
        """llguidance's thread pool for a batch's masks (made on first use)."""
        if self._executor is None:
            self._executor = _llg().LLExecutor(num_threads=2)
        return self._executor


class _ByteTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each token's bytes (a special
    token's as llguidance marks them: 0xFF, then its name) and how to tokenize text."""

    def __init__(self, tokenizer: TokenizerProtocol, vocab_size: int, eos: list[int]):
        self._tok = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = tokenizer.bos_token_id
        known = int(tokenizer.vocab_size)
        special = set(tokenizer.special_ids) | set(range(known, vocab_size))
        self.special_token_ids = sorted(special)  # with the ids past the tokenizer: padding
        self.tokens = [b"\xff" + (tokenizer.decode([i]).encode() if i < known else
                                  f"<[pad {i}]>".encode()) if i in special
                       else tokenizer.token_bytes(i) for i in range(vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return list(self._tok.encode(s))


_GRAMMARS: weakref.WeakKeyDictionary[TokenizerProtocol, Grammars] = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def has_grammars(tokenizer: TokenizerProtocol, vocab_size: int) -> bool:
    """Whether the tokenizer's grammar data is built already."""
    g = _GRAMMARS.get(tokenizer)
    return g is not None and g.vocab_size == vocab_size


def grammars_for(tokenizer: TokenizerProtocol, vocab_size: int,
                 stop_ids: Sequence[int]) -> Grammars:
    """The `Grammars` of a tokenizer, built on first use and kept while the tokenizer lives."""
    with _GRAMMARS_LOCK:
        g = _GRAMMARS.get(tokenizer)
        if g is None or g.vocab_size != vocab_size:
            g = Grammars(tokenizer, vocab_size, stop_ids)
            _GRAMMARS[tokenizer] = g
        return g


# ----------------------------------------------------------------------------- masks


def compute_masks(grammars: Grammars, matchers: Sequence[LLMatcher]) -> torch.Tensor:
    """The next-token bitmasks (R, ceil(V / 32)) int32 of `matchers`, in parallel."""
    words = (grammars.vocab_size + 31) // 32
    masks = torch.empty(len(matchers), words, dtype=torch.int32)
    grammars.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              masks.data_ptr(), words * 4, len(matchers))
    return masks


FORBIDDEN = float(torch.finfo(torch.float32).min)  # added to a forbidden token's logit


def apply_masks_(logits: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> None:
    """Forbid (in place) the tokens that the bitmasks (R, W) do not allow, in rows `rows` of
    float32 logits (B, V): their logits drop by float32's largest magnitude, to -inf or to
    about -3.4e38, which sampling gives exactly zero probability. An addition, not a
    masked_fill, which is several times slower on CPU; the bits are unpacked by numpy."""
    V = logits.shape[-1]
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")  # (R, 32W)
    allowed = torch.from_numpy(bits[:, :V])
    if allowed.shape[1] < V:  # logits past the tokenizer's vocabulary: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), V - allowed.shape[1])], 1)
    penalty = allowed.to(logits.device, torch.float32, non_blocking=True).sub_(1.0) \
        .mul_(-FORBIDDEN)  # 0 where allowed, FORBIDDEN where not
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.add_(penalty)
        return
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    logits.index_add_(0, idx, penalty)


def allows_besides(mask: torch.Tensor, ids: Sequence[int]) -> bool:
    """Whether the bitmask row `mask` (W,) int32 allows some token not in `ids`: the end
    tokens that min_tokens or ignore_eos hold back are held only where the grammar lets the
    answer go on."""
    words = mask.numpy().view(np.uint32).copy()
    for i in ids:
        if i >> 5 < len(words):
            words[i >> 5] &= np.uint32(~(1 << (i & 31)) & 0xFFFFFFFF)
    return bool(words.any())


class MaskJob:
    """A batch's masks, computed on one worker thread for the process (so that llguidance's
    pool is never entered from two threads at once, whatever the number of engines), started
    before the model's forward so that the two overlap; `result()` waits for them. llguidance
    drops the GIL while it works."""

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, grammars: Grammars, rows: list[int], matchers: Sequence[LLMatcher]):
        self.rows = rows  # the batch rows the masks are for
        self._future: Future[torch.Tensor] = self._worker().submit(compute_masks, grammars,
                                                                   list(matchers))

    @classmethod
    def _worker(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(1, thread_name_prefix="nbserve-masks")
            return cls._pool

    def result(self) -> torch.Tensor:
        return self._future.result()
