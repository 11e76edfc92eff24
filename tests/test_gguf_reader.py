"""`BulkArrayReader` (nbserve/loading/gguf_reader.py) against gguf's own `GGUFReader`: the
same fields (offsets, parts, data indices, types, contents) and tensors, on the real default
model and on a file with every kind of metadata value; the stock errors for broken files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from nbserve.loading.gguf_reader import BulkArrayReader

V = gguf.GGUFValueType


def assert_same(path: Path) -> None:
    stock, bulk = gguf.GGUFReader(path), BulkArrayReader(path)
    assert list(stock.fields) == list(bulk.fields)
    for key, a in stock.fields.items():
        b = bulk.fields[key]
        assert (a.offset, a.name, a.types, a.data) == (b.offset, b.name, b.types, b.data), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), key
        assert a.contents() == b.contents(), key
        if a.data:
            assert a.contents(0) == b.contents(0) and a.contents(-1) == b.contents(-1), key
    assert stock.data_offset == bulk.data_offset
    for s, t in zip(stock.tensors, bulk.tensors, strict=True):
        assert (s.name, s.tensor_type, s.data_offset, s.shape.tolist()) == \
            (t.name, t.tensor_type, t.data_offset, t.shape.tolist())
        assert np.array_equal(np.asarray(s.data), np.asarray(t.data))


def every_kind_file(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_key_value("t.u8s", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.i16s", [-3, 7], V.ARRAY, sub_type=V.INT16)
    w.add_key_value("t.u32s", list(range(1000)), V.ARRAY, sub_type=V.UINT32)
    w.add_key_value("t.i64s", [-(2**40), 5], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("t.f32s", [0.5, -1e-6, 3.25], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.f64s", [1e300], V.ARRAY, sub_type=V.FLOAT64)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("t.strs", ["", "a", "héllo", "Ġworld", "x" * 300], V.ARRAY,
                    sub_type=V.STRING)
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)
    w.add_key_value("t.scalar", 7, V.UINT32)
    w.add_key_value("t.text", "plain", V.STRING)
    w.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_kind_of_value_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = every_kind_file(tmp_path / "kinds.gguf")
    assert_same(path)
    fields = BulkArrayReader(path).fields
    assert fields["t.strs"].contents() == ["", "a", "héllo", "Ġworld", "x" * 300]
    assert fields["t.u32s"].contents() == list(range(1000))


def test_empty_arrays_read_as_gguf_reads_them(tmp_path: Path) -> None:
    """gguf's writer refuses empty arrays; llama.cpp's writes them: a file made by hand."""
    import struct

    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    body += key("general.architecture") + struct.pack("<I", V.STRING) + key("llama")
    body += key("t.no_strs") + struct.pack("<IIQ", V.ARRAY, V.STRING, 0)
    body += key("t.no_ints") + struct.pack("<IIQ", V.ARRAY, V.INT32, 0)
    path = tmp_path / "empty.gguf"
    path.write_bytes(body + b"\0" * 64)
    assert_same(path)
    assert BulkArrayReader(path).fields["t.no_strs"].contents() == []


def test_the_default_model_reads_as_gguf_reads_it() -> None:
    from nbserve.loading.default import default_model_path

    assert_same(default_model_path())


def test_a_truncated_array_fails_as_gguf_fails(tmp_path: Path) -> None:
    path = every_kind_file(tmp_path / "kinds.gguf")
    raw = path.read_bytes()
    cut = raw.index(b"x" * 300) + 100  # inside the last string of t.strs
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:cut])
    with pytest.raises(Exception) as stock:
        gguf.GGUFReader(short)
    with pytest.raises(type(stock.value)):
        BulkArrayReader(short)
