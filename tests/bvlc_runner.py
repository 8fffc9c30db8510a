"""Runs BVLC Caffe's pycaffe unit tests, as unittest would, and writes each test's outcome
as JSON: `cgp pycaffe tests/bvlc_runner.py OUT.json TESTDIR MODULE...` (tests/test_bvlc_pycaffe.py
runs it; `import caffe` in them is cgp through the alias)."""
import json
import sys
import traceback
import unittest


class Outcomes(unittest.TestResult):
    """{test id: (outcome, detail)}: 'ok', 'fail', 'error', 'skip' (the reason)."""

    def __init__(self):
        super().__init__()
        self.outcomes = {}

    def addSuccess(self, test):
        self.outcomes[test.id()] = ("ok", "")

    def addFailure(self, test, err):
        self.outcomes[test.id()] = ("fail", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        self.outcomes[test.id()] = ("error", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        self.outcomes[test.id()] = ("skip", reason)


def main(out, folder, modules):
    sys.path.insert(0, folder)
    result = Outcomes()
    for name in modules:
        try:
            suite = unittest.defaultTestLoader.loadTestsFromName(name)
        except Exception:   # noqa: BLE001  (a module that does not load: its error, reported)
            result.outcomes[name] = ("error", traceback.format_exc())
            continue
        suite.run(result)
    with open(out, "w") as f:
        json.dump(result.outcomes, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
