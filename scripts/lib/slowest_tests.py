#!/usr/bin/env python3
"""Prints the slowest tests of a cargo-nextest run from its JUnit report.

    python3 scripts/lib/slowest_tests.py target/nextest/default/junit.xml [N]

N defaults to 10. Each line: seconds, the test binary and the test's name,
and its result when it did not pass (failed, timed out).
"""

import sys
import xml.etree.ElementTree as ET


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"no test timings: cannot read {path}: {e}", file=sys.stderr)
        return 1
    cases = []
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            result = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    message = child.get("message") or child.get("type") or child.tag
                    result = message.split("\n")[0]
            seconds = float(case.get("time") or 0)
            cases.append((seconds, suite.get("name", "?"), case.get("name", "?"), result))
    cases.sort(key=lambda c: c[0], reverse=True)
    total = sum(c[0] for c in cases)
    print(f"the {min(count, len(cases))} slowest of {len(cases)} tests ({total:.0f} s of test time in all):")
    for seconds, suite, name, result in cases[:count]:
        note = "" if result == "passed" else f"  [{result}]"
        print(f"  {seconds:8.1f} s  {suite} {name}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
