"""The text layer: tokenizer wrapper, sandboxed chat templates, streaming detokenizer, stop strings.

Server and UI both go messages -> `ChatTemplate.render` -> `Tokenizer.encode`, and token ids ->
`IncrementalDetokenizer` -> `StopStringMatcher` -> text deltas.
"""

from .chat_template import ChatTemplate
from .streaming import IncrementalDetokenizer, StopStringMatcher
from .tokenizer import Tokenizer, TokenizerProtocol

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer",
           "TokenizerProtocol"]
