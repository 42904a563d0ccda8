#!/usr/bin/env python3
"""Programmatic dependent launch's rule (kernels/host/launch.cuh), read from the sources: every
__global__ function in kernels/ begins with await_previous_kernel(); (its griddepcontrol.wait comes
before any memory access), and no kernel in kernels/ is launched with <<<>>> (which cannot carry the
launch attribute: every one goes through launch_kernel, so that --launch-overlap pdl covers them
all). The emulator checks the same at run time for the accesses it sees (test_checks); this
catches a kernel no test runs, and a wait placed after a plain load, which the emulator cannot see.
The rule itself is checked against hand-written sources, so that a parser that found nothing
cannot pass."""
import pathlib
import re
import sys
import unittest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GLOBAL = re.compile(r"__global__\b")
FIRST_STATEMENT = "await_previous_kernel();"


def strip_comments(text):
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def past_parentheses(text, i):
    """The index after the parenthesis that opens at text[i] closes."""
    depth = 0
    while True:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            return i


def kernel_entries(text):
    """(kernel name, its body's first statement) of every __global__ function in `text`."""
    text = strip_comments(text)
    entries = []
    for match in GLOBAL.finditer(text):
        start = match.end()
        open_paren = text.index("(", start)
        if "__launch_bounds__" in text[start:open_paren]:  # the parameters open after the bounds' parentheses
            start = past_parentheses(text, open_paren)
            open_paren = text.index("(", start)
        name = text[start:open_paren].split()[-1]
        body = text.index("{", past_parentheses(text, open_paren))
        entries.append((name, " ".join(text[body + 1:text.index(";", body) + 1].split())))
    return entries


def violations(text):
    """What breaks the rule in a source: kernels whose first statement is not the wait, <<<>>> launches."""
    found = [f"{name} begins with '{first}'" for name, first in kernel_entries(text) if first != FIRST_STATEMENT]
    found += [f"a <<<>>> launch: {line.strip()}" for line in strip_comments(text).splitlines() if "<<<" in line]
    return found


class KernelEntryTest(unittest.TestCase):
    def test_every_kernel_waits_first_and_goes_through_launch_kernel(self):
        sources = sorted((ROOT / "kernels").glob("*.cuh"))
        kernels = sum(len(kernel_entries(path.read_text())) for path in sources)
        print(f"{kernels} kernels in {len(sources)} headers")
        self.assertGreater(kernels, 40)
        for path in sources:
            with self.subTest(path=path.name):
                self.assertEqual(violations(path.read_text()), [])

    def test_the_rule_finds_what_breaks_it(self):
        waits = ("template <int v>\n__global__ void __launch_bounds__(256, v <= 3 ? 4 : 2)\n"
                 "    good_kernel(const float* x /* (x) */, float* y) {\n  await_previous_kernel();\n  y[0] = x[0];\n}\n")
        self.assertEqual(kernel_entries(waits), [("good_kernel", FIRST_STATEMENT)])
        self.assertEqual(violations(waits), [])
        late = "__global__ void late_kernel(const float* x, float* y) {\n  y[0] = x[0];\n  await_previous_kernel();\n}\n"
        self.assertEqual(violations(late), ["late_kernel begins with 'y[0] = x[0];'"])
        launched = "void f(float* y) {\n  late_kernel<<<1, 32, 0, stream>>>(y, y);\n}\n"
        self.assertEqual(violations(launched), ["a <<<>>> launch: late_kernel<<<1, 32, 0, stream>>>(y, y);"])


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
