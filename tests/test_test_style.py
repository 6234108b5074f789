"""The suite's own style: a failing assert says what failed.

An ``assert`` on a bare boolean (``assert flag``, ``assert all(...)``, ``assert torch.equal(a, b)``,
``assert x == 1 and y == 2``) fails with ``assert False`` and nothing else: it needs a message naming
the figures. A comparison (``assert a == b``) may go without one, since pytest's rewrite shows both
sides. This reads every file under tests/ and names the file:line of each assert that breaks it.
"""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def bare_asserts(source: str) -> list[int]:
    """Lines of the asserts with no message whose test is not a comparison."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Assert) and node.msg is None
                  and not isinstance(node.test, ast.Compare))


def test_the_check_finds_bare_booleans_and_lets_comparisons_and_messages_pass():
    source = "\n".join([
        "assert flag",                          # 1: bare
        "assert all(x for x in xs)",            # 2: bare
        "assert a == 1 and b == 2",             # 3: bare (a BoolOp, not a Compare)
        "assert a == b",                        # 4: a comparison, pytest shows both sides
        "assert flag, f'figures {xs}'",         # 5: a message
        "assert not torch.equal(a, b)",         # 6: bare
    ])
    assert bare_asserts(source) == [1, 2, 3, 6], bare_asserts(source)


def test_no_assert_on_a_bare_boolean_without_a_message():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        lines = path.read_text().splitlines()
        for line in bare_asserts(path.read_text()):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{line}: {lines[line - 1].strip()}")
    assert not offenders, (
        f"{len(offenders)} assert(s) on a bare boolean without a message (give each a message "
        "naming the figures, or compare with ==):\n" + "\n".join(offenders))
