"""The Python side of the C kernels' interface, read from `nbserve_kernels.h` (its one home).

The header declares the weight kinds, the matmul flags, the structs and every exported
function. This module parses it (the small subset of C the header keeps to, described at its
top) once, at import, and gives:
- `WeightKind`, `BlockType` and `KernelFlag`, whose values are the header's enums;
- `Weight` and `Layer`, ctypes structures laid out field by field as `nbq_weight` and
  `nbq_layer`;
- `declare(lib)`, which sets every exported function's ctypes argument and result types from its
  prototype, so that a call converts its arguments as the C side reads them.
A signature, field or value changed in the header changes all of these with it; the C files
include the header, so the compiler holds every definition to it (tests/test_kernel_abi.py
checks the rest: the ctypes layouts against the compiler's, the library's exports, and the
number of arguments at each Python call site).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from pathlib import Path

HEADER = Path(__file__).with_name("nbserve_kernels.h")

# C scalar types the header may use, as ctypes types; any pointer passes as an address
SCALARS: dict[str, type[ctypes._SimpleCData]] = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_QUALIFIERS = {"const", "volatile", "struct", "enum", "unsigned", "signed"}
_WORD = re.compile(r"[A-Za-z_]\w*")
# `typedef struct [tag] { fields } name;`: the fields and the name (a tag lets fields point to it)
_STRUCT = r"\btypedef\s+struct\s*(?:\w+\s*)?\{(.*?)\}\s*(\w+)\s*;"


class HeaderError(ValueError):
    """The header uses C that this parser does not read; the message says where."""


@dataclass(frozen=True)
class Param:
    """One parameter or struct field: its name, its base type and whether it is a pointer."""

    name: str
    type: str
    pointer: bool


@dataclass(frozen=True)
class Function:
    """One prototype: its result (a Param named after the function) and its parameters."""

    name: str
    result: Param
    params: tuple[Param, ...]


@dataclass(frozen=True)
class Header:
    """What the header declares: enum constants, structs' fields in order, prototypes."""

    constants: dict[str, int]
    enums: dict[str, dict[str, int]]
    structs: dict[str, tuple[Param, ...]]
    functions: dict[str, Function]


def _strip(text: str) -> str:
    """The header without comments and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"^[ \t]*#[^\n]*", "", text, flags=re.M)


def _declarators(declaration: str) -> list[Param]:
    """`const half_t *d, *m` -> [Param(d, half_t, True), Param(m, half_t, True)]."""
    first, *rest = declaration.split(",")
    last = re.search(r"[\s*]*\w+\s*$", first)
    base = [] if last is None else \
        [w for w in _WORD.findall(first[:last.start()]) if w not in _QUALIFIERS]
    if last is None or len(base) != 1:
        raise HeaderError(f"cannot read the declaration {declaration.strip()!r}")
    out = []
    for part in [last.group(), *rest]:
        names = _WORD.findall(part)
        if len(names) != 1 or not re.fullmatch(r"[\s*]*\w+\s*", part):
            raise HeaderError(f"cannot read the declarator {part.strip()!r} in "
                              f"{declaration.strip()!r}")
        out.append(Param(names[0], base[0], "*" in part))
    return out


def parse(text: str) -> Header:
    """The declarations of a header written in the subset `nbserve_kernels.h` keeps to; a
    HeaderError names any statement outside it."""
    text = _strip(text)
    constants: dict[str, int] = {}
    enums: dict[str, dict[str, int]] = {}
    for match in re.finditer(r"\benum\s+(\w+)\s*\{(.*?)\}\s*;", text, flags=re.S):
        values = {}
        for item in filter(None, (i.strip() for i in match.group(2).split(","))):
            found = re.fullmatch(r"(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))", item)
            if not found:
                raise HeaderError(f"enum {match.group(1)}: give {item!r} an explicit value")
            values[found.group(1)] = int(found.group(2), 0)
        enums[match.group(1)] = values
        constants.update(values)
    structs = {}
    for match in re.finditer(_STRUCT, text, flags=re.S):
        fields = [p for decl in match.group(1).split(";") if decl.strip()
                  for p in _declarators(decl)]
        structs[match.group(2)] = tuple(fields)
    rest = re.sub(rf"\benum\s+\w+\s*\{{.*?\}}\s*;|{_STRUCT}", "", text, flags=re.S)
    functions = {}
    for statement in filter(None, (s.strip() for s in rest.split(";"))):
        if re.fullmatch(r"typedef\s+\w+\s+\w+", statement):  # a scalar's alias (half_t)
            continue
        found = re.fullmatch(r"([^()]+)\(([^()]*)\)", statement, flags=re.S)
        if not found:
            raise HeaderError(f"cannot read {statement!r} (see the subset at the header's top)")
        (result,) = _declarators(found.group(1))
        params = found.group(2).strip()
        args = [] if params in ("", "void") else \
            [p for decl in params.split(",") for p in _declarators(decl)]
        functions[result.name] = Function(result.name, result, tuple(args))
    return Header(constants, enums, structs, functions)


ABI = parse(HEADER.read_text())


class WeightKind(IntEnum):
    """A weight's storage in `nbq_weight.kind` (enum nbq_kind)."""

    Q4 = ABI.constants["NBQ_Q4"]
    Q8 = ABI.constants["NBQ_Q8"]
    F32 = ABI.constants["NBQ_F32"]
    BLOCKS = ABI.constants["NBQ_BLOCKS"]
    PARTS = ABI.constants["NBQ_PARTS"]


class BlockType(IntEnum):
    """The GGUF block types of `nbq_blocks_*` (enum nbq_ggml_type): ggml's type numbers, so
    a `gguf.GGMLQuantizationType` converts as it is."""

    Q4_0 = ABI.constants["NBQ_GGML_Q4_0"]
    Q4_1 = ABI.constants["NBQ_GGML_Q4_1"]
    Q5_0 = ABI.constants["NBQ_GGML_Q5_0"]
    Q5_1 = ABI.constants["NBQ_GGML_Q5_1"]
    Q8_0 = ABI.constants["NBQ_GGML_Q8_0"]
    Q2_K = ABI.constants["NBQ_GGML_Q2_K"]
    Q3_K = ABI.constants["NBQ_GGML_Q3_K"]
    Q4_K = ABI.constants["NBQ_GGML_Q4_K"]
    Q5_K = ABI.constants["NBQ_GGML_Q5_K"]
    Q6_K = ABI.constants["NBQ_GGML_Q6_K"]
    IQ4_NL = ABI.constants["NBQ_GGML_IQ4_NL"]
    IQ4_XS = ABI.constants["NBQ_GGML_IQ4_XS"]


class KernelFlag(IntFlag):
    """The matmul entry points' `flags` (enum nbq_flag)."""

    GATED = ABI.constants["NBQ_GATED"]
    ROUND16 = ABI.constants["NBQ_ROUND16"]
    ROUND8 = ABI.constants["NBQ_ROUND8"]
    ROUND8_MANY = ABI.constants["NBQ_ROUND8_MANY"]


def ctype(param: Param) -> type:
    """The ctypes type a parameter or field is passed or stored as."""
    if param.pointer:
        return ctypes.c_void_p
    if param.type in SCALARS:
        return SCALARS[param.type]
    if param.type in STRUCTS:
        return STRUCTS[param.type]
    raise HeaderError(f"{param.name}: no ctypes type for {param.type!r} (add it to SCALARS)")


def _struct(name: str) -> type[ctypes.Structure]:
    class Struct(ctypes.Structure):
        __slots__ = ()  # no __dict__: a field the header lacks raises instead of being kept aside

    Struct.__name__ = Struct.__qualname__ = name
    Struct._fields_ = [(p.name, ctype(p)) for p in ABI.structs[name]]
    STRUCTS[name] = Struct
    return Struct


STRUCTS: dict[str, type[ctypes.Structure]] = {}
Weight = _struct("nbq_weight")  # in header order: each struct after those it holds
Layer = _struct("nbq_layer")


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every function of the header given its ctypes argument and result types
    (the attributes `lib.nbq_...` the callers use, set once here)."""
    for fn in ABI.functions.values():
        entry = lib[fn.name]
        entry.argtypes = [ctype(p) for p in fn.params]
        void = fn.result.type == "void" and not fn.result.pointer
        entry.restype = None if void else ctype(fn.result)
        setattr(lib, fn.name, entry)
    return lib
