"""Test helper: transformers reading one GGUF file several times, with its parsing done once.

transformers opens a GGUF through `gguf.GGUFReader` for the tokenizer, again for the config and
again for the weights, and builds gguf's tensor-name map once per submodule (about 400 times for
a 30-layer model). Both are pure reads of the same unchanged file, so within `parsed_once()` a
file's reader is made once and reused, and the name map is built once per architecture and
depth: transformers' own code still reads the model, tokenizer and config, from the same parsed
fields and memory-mapped tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` returns one reader per unchanged file and
    `gguf.get_tensor_name_map` is memoized; both are restored (and the readers dropped) after.
    transformers imports both from `gguf` where it uses them, so it sees the memoized ones."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[Any, ...], Any] = {}

    def reader(path: Any, mode: Any = "r") -> Any:
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), mode, stat.st_mtime_ns, stat.st_size)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader = real_reader  # type: ignore[misc]
        gguf.get_tensor_name_map = real_map
        readers.clear()
