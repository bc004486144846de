"""No test compares floats bitwise where BLAS or a library version may round differently.

A bitwise comparison (torch.equal, numpy's array_equal, assert_close with rtol=0 and atol=0) is right only where
exactness is the claim and it is deterministic: integer tensors, indices, bools, bytes copied unchanged (a slice,
a gather, a safetensors round trip), or the very same ops in the same order on the same shapes. Each such line
says why with a `# exact: <reason>` comment in its statement (a formatter may move a comment to the end of a
statement it splits over lines) or on one of the 3 lines above it; two different computations
that are only mathematically equal are compared with torch.testing.assert_close and a tolerance instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WINDOW = 3  # the marker may sit on the comparison's line or on one of the lines above it
MARKER = re.compile(r"#.*\bexact:\s*\S")
BITWISE = re.compile(
    r"\btorch\.equal\(|\.equal\(|\barray_equal\(|\bassert_array_equal\("
    r"|\brtol=0(?:\.0)?\s*,\s*atol=0(?:\.0)?\b(?!\.)|\batol=0(?:\.0)?\s*,\s*rtol=0(?:\.0)?\b(?!\.)"
)


def _statement_spans(source: str) -> dict[int, tuple[int, int]]:
    """line (1-based) → (first, last) line of the innermost simple statement holding it."""
    spans: dict[int, tuple[int, int]] = {}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return spans
    simple = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not hasattr(n, "body")]
    for n in sorted(simple, key=lambda n: n.end_lineno - n.lineno, reverse=True):  # innermost last wins
        for line in range(n.lineno, n.end_lineno + 1):
            spans[line] = (n.lineno, n.end_lineno)
    return spans


def unjustified(source: str) -> list[int]:
    """The 1-based numbers of the code lines comparing bitwise without a `# exact:` marker in their statement
    or on one of the WINDOW lines above it."""
    lines = source.splitlines()
    spans = _statement_spans(source)
    bad = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if not BITWISE.search(code):
            continue
        first, last = spans.get(i + 1, (i + 1, i + 1))
        if not any(MARKER.search(lines[j]) for j in range(max(0, first - 1 - WINDOW), last)):
            bad.append(i + 1)
    return bad


def test_every_bitwise_float_comparison_says_why_it_is_exact():
    here = Path(__file__).resolve()  # this file's samples are checked by the test below
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() == here or "__pycache__" in path.parts:
            continue
        source = path.read_text()
        for line in unjustified(source):
            offenders.append(f"{path.relative_to(TESTS)}:{line}: {source.splitlines()[line - 1].strip()}")
    assert not offenders, (
        "bitwise comparisons without a '# exact: <reason>' comment on the line or the "
        f"{WINDOW} above (else compare with a tolerance):\n" + "\n".join(offenders)
    )


def test_the_guard_catches_a_comparison_without_its_reason():
    eq = "torch.equal"
    ok = (
        f"def test_a():\n"
        f"    assert {eq}(a[idx], b)  # exact: a gather copies bytes\n"
        f"    x = 1\n"
        f"    y = 2\n"
        f"    # exact: copied bytes, the three lines below\n"
        f"    assert {eq}(c, d)\n"
        f"    assert {eq}(e, f)\n"
        f"    assert not {eq}(g, h)\n"
    )
    assert unjustified(ok) == []
    assert unjustified(ok.replace("# exact: a gather copies bytes", "# a gather copies bytes")) == [2]
    assert unjustified(ok.replace("exact: copied", "copied")) == [6, 7, 8]
    far = ok.replace("    assert not", "    x = 1\n    assert not")  # the marker is now 4 lines above
    assert unjustified(far) == [9]
    assert unjustified("assert torch.equal(a, b)  # exact:\n") == [1]  # a marker without a reason
    assert unjustified(f"# exact: the comparison is in a comment: {eq}(a, b)\nx = 1\n") == []
    rtol0 = "torch.testing.assert_close(a, b, rtol=0, atol=0)\n"
    assert unjustified(rtol0) == [1] and unjustified("# exact: copied bytes\n" + rtol0) == []
    assert unjustified("torch.testing.assert_close(a, b, rtol=0, atol=1e-12)\n") == []
    assert unjustified("np.array_equal(a, b)\n") == [1]
    split = f"assert {eq}(\n    a, b\n)  # exact: copied bytes\n"  # a formatter put the comment at the end
    assert unjustified(split) == [] and unjustified(split.replace("# exact: copied bytes", "")) == [1]
    two = f"x = 1  # exact: about x only\ny = 2\nz = 3\nw = 4\nassert {eq}(\n    a, b\n)\n"
    assert unjustified(two) == [5]  # another statement's marker, 4 lines up, does not count
