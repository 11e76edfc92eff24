"""The C kernels' interface is written once, in nbserve/cpu/kernels/nbserve_kernels.h, and the
Python side (cpu/kernels/abi.py) is read from it: these tests change nothing and fail where the
two could still disagree. The C compiler says what the header means (each struct's size and
offsets, each enum's value, each prototype's argument count and kinds) and whether every
exported function of the sources is declared there; the library has every declared function;
and every Python call of a kernel passes as many arguments as its prototype takes."""

from __future__ import annotations

import ast
import ctypes
import re
import subprocess
from pathlib import Path

import pytest
from kernel_paths import NEEDS_COMPILER

from nbserve.cpu.kernels import abi, build

pytestmark = NEEDS_COMPILER
ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "nbserve" / "cpu" / "kernels"
# a value of the C type each ctypes type passes, in the probe below
PROBE_ARG = {ctypes.c_void_p: "p", ctypes.c_int: "i", ctypes.c_int32: "i32",
             ctypes.c_float: "f", ctypes.c_double: "g"}


def _probe_source() -> str:
    """A C program, over the header, that prints what the compiler makes of it: each struct's
    size and field offsets, each enum constant's value."""
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "nbserve_kernels.h"',
             "int main(void) {"]
    for name, fields in abi.ABI.structs.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'    printf("{name}.{p.name} %zu\\n", offsetof({name}, {p.name}));'
                  for p in fields]
    lines += [f'    printf("{name} %d\\n", (int){name});' for name in abi.ABI.constants]
    return "\n".join([*lines, "    return 0;", "}", ""])


def _calls_source() -> str:
    """C that calls every prototype of the header with one value of the C type each of its
    ctypes argument types stands for (compiled, not run)."""
    lines = ['#include "nbserve_kernels.h"',
             "void probe(void *p, int i, int32_t i32, float f, double g);",
             "void probe(void *p, int i, int32_t i32, float f, double g) {",
             "    (void)p; (void)i; (void)i32; (void)f; (void)g;"]
    for fn in abi.ABI.functions.values():
        args = ", ".join(PROBE_ARG[abi.ctype(p)] for p in fn.params)
        lines.append(f"    (void){fn.name}({args});")
    return "\n".join([*lines, "}", ""])


def _compile(tmp_path: Path, sources: list[str], *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([build.compiler(), "-std=c11", *options,
                           f"-I{KERNELS}", *sources], capture_output=True, text=True,
                          cwd=tmp_path, check=False)


def test_the_ctypes_side_is_what_the_compiler_reads_in_the_header(tmp_path):
    """Struct layouts, enum values and prototypes as abi.py declares them are the compiler's:
    a field, a value or an argument added, removed, reordered or retyped in the header (or
    misread by abi.py's parser) fails here."""
    (tmp_path / "calls.c").write_text(_calls_source())
    # -Wconversion: an int passed for a float (or back), or a double for a float, is an error
    made = _compile(tmp_path, ["calls.c"], "-fsyntax-only", "-Wall", "-Wconversion", "-Werror")
    assert made.returncode == 0, made.stderr
    (tmp_path / "probe.c").write_text(_probe_source())
    made = _compile(tmp_path, ["probe.c"], "-o", "probe")
    assert made.returncode == 0, made.stderr
    printed = dict(line.rsplit(" ", 1) for line in subprocess.run(
        [str(tmp_path / "probe")], capture_output=True, text=True, check=True).stdout.split("\n")
        if line)
    for name, struct in abi.STRUCTS.items():
        assert int(printed[name]) == ctypes.sizeof(struct), name
        for field, _ in struct._fields_:
            assert int(printed[f"{name}.{field}"]) == getattr(struct, field).offset, field
    assert {name: int(printed[name]) for name in abi.ABI.constants} == abi.ABI.constants


def test_every_exported_function_is_declared_in_the_header(tmp_path):
    """Each source compiles with the header against -Wmissing-prototypes: a function the
    library exports but the header does not declare (so ctypes would call it untyped), or a
    definition that disagrees with its prototype, fails; and the library has each function."""
    sources = sorted(str(p) for p in KERNELS.glob("*.c"))
    assert {Path(s).name for s in sources} == {p.name for p in build.SOURCES}
    made = _compile(tmp_path, sources, "-fsyntax-only", "-fopenmp",  # only what this test is for
                    "-Werror=missing-prototypes", "-Werror=int-conversion")
    assert made.returncode == 0, made.stderr
    lib = build.quant_kernels()
    for name in abi.ABI.functions:
        assert getattr(lib, name).argtypes is not None, name  # declared by abi.declare


def test_enums_of_the_header_are_the_python_enums():
    """WeightKind and KernelFlag have a member for each constant of their enum, with its
    value: a kind or flag added to the header without its Python name fails."""
    assert {f"NBQ_{m.name}": m.value for m in abi.WeightKind} == abi.ABI.enums["nbq_kind"]
    assert {f"NBQ_{m.name}": m.value for m in abi.KernelFlag} == abi.ABI.enums["nbq_flag"]


def _kernel_calls(path: Path) -> list[tuple[str, int, int | None]]:
    """(function, line, positional arguments, None where a *args hides the count) of each call
    of a kernel in a Python file: `lib.nbq_x(...)`, or `pick(lib, "nbq_x", ...)(...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        names = []
        if isinstance(node.func, ast.Attribute) and node.func.attr.startswith("nbq_"):
            names = [node.func.attr]
        elif isinstance(node.func, ast.Call):  # a chooser: the name and its _f16 twin
            names = [a.value + suffix for a in node.func.args if isinstance(a, ast.Constant)
                     and isinstance(a.value, str) and a.value.startswith("nbq_")
                     for suffix in ("", "_f16")]
        count = None if any(isinstance(a, ast.Starred) for a in node.args) else len(node.args)
        found += [(name, node.lineno, count) for name in names]
    return found


def test_every_python_call_of_a_kernel_passes_its_prototypes_arguments():
    """A prototype given an argument more or less fails here until every caller follows (ctypes
    itself lets a call with too many arguments through)."""
    files = [p for folder in ("nbserve", "benchmarks", "tests") for p in
             (ROOT / folder).rglob("*.py")]
    calls = [(path, *call) for path in files for call in _kernel_calls(path)]
    assert len(calls) >= 10  # the quantized matmuls, the attention kernels, the stack...
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name} with {count} arguments"
             for path, name, line, count in calls
             if name not in abi.ABI.functions or count != len(abi.ABI.functions[name].params)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, problem", [
    ("enum e { A };", "explicit value"),
    ("typedef struct { int a[4]; } s;", "cannot read"),
    ("typedef struct { int a, b[2]; } s;", "cannot read the declarator"),
    ("int f(int (*cb)(void));", "cannot read"),
    ("struct s { int a; };", "cannot read"),
])
def test_c_outside_the_parsed_subset_is_refused_by_name(text, problem):
    """Anything the parser does not read raises, naming it, rather than being skipped."""
    with pytest.raises(abi.HeaderError, match=re.escape(problem)):
        abi.parse(text)


def test_a_tagged_struct_may_point_to_itself():
    """`typedef struct name { ... } name;` reads as the untagged form; a field pointing to
    `struct name` (nbq_weight's parts) is an address."""
    header = abi.parse("typedef struct w { int32_t n; const struct w *part; } w;")
    assert header.structs["w"] == (abi.Param("n", "int32_t", False),
                                   abi.Param("part", "w", True))
    assert not header.functions


def test_a_misspelled_field_raises():
    """The structs have no __dict__: a field name the header lacks is an error, not a new
    attribute the C side never sees."""
    weight = abi.Weight()
    weight.kind = abi.WeightKind.Q8
    assert weight.kind == 1
    with pytest.raises(AttributeError):
        weight.knid = 1  # type: ignore[attr-defined]
