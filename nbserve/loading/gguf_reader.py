"""gguf's `GGUFReader`, with metadata arrays read in bulk.

The stock reader decodes a metadata array one element at a time, each through a fresh numpy
view and a recursive call: a vocabulary of 49k tokens, its scores and its 49k merges take
seconds, most of the time a default-model load spends. `BulkArrayReader` reads an array of
numbers as one view and an array of strings by walking its length prefixes in a memoryview,
and hands `GGUFReader` the same parts, data indices and types the stock code builds, so
`ReaderField.contents()` and everything after it is gguf's own. Anything unusual (a
byte-swapped file, nested arrays, an array the bulk walk cannot read) goes to the stock code.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_ARRAY_HEAD = 12  # item type (uint32) and count (uint64)


class BulkArrayReader(GGUFReader):
    """`GGUFReader` whose `_get_field_parts` reads arrays of numbers or strings in bulk."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any],
                                                                       list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n, offs = int(alen[0]), orig_offs + _ARRAY_HEAD
        try:
            itype = GGUFValueType(int(raw_itype[0]))
        except ValueError:
            return super()._get_field_parts(orig_offs, raw_type)  # it raises the stock error
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            if len(values) != n:  # truncated: the stock code says so
                return super()._get_field_parts(orig_offs, raw_type)
            # one part of one value each, as stock; plain views (a memmap's cost per view is
            # most of the stock reader's time)
            elements = list(np.asarray(values).reshape(n, 1))
            return (_ARRAY_HEAD + int(values.nbytes), [raw_itype, alen, *elements],
                    list(range(2, 2 + n)), types)
        if itype == GGUFValueType.STRING:
            return self._string_array(orig_offs, raw_itype, alen, n, types)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs: int, raw_itype: Any, alen: Any, n: int,
                      types: list[Any]) -> tuple[int, list[Any], list[int], list[Any]]:
        data = np.asarray(self.data)  # plain views of the map, not memmaps (see above)
        raw = data.data  # a memoryview of the same bytes
        size = len(raw)
        parts: list[Any] = [raw_itype, alen]
        offs = orig_offs + _ARRAY_HEAD
        unpack = struct.Struct("=Q").unpack_from  # byte_order "I": the file's order is ours
        for _ in range(n):
            if offs + 8 > size:
                return super()._get_field_parts(orig_offs, GGUFValueType.ARRAY)
            (length,) = unpack(raw, offs)
            end = offs + 8 + length
            if end > size:
                return super()._get_field_parts(orig_offs, GGUFValueType.ARRAY)
            parts.append(data[offs:offs + 8].view(np.uint64))
            parts.append(data[offs + 8:end])
            offs = end
        return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types
