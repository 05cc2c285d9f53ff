"""The checkers pack authors run, on the pack as a user who clones it gets it (tests/outside_checkers.py says how):
comfy-import-guard check against ComfyUI v0.33.0 says SAFE, and comfy-test lint passes. Each runs where it is
installed (tests/requirements-checkers.txt, in .checkers/ by tests/setup_checkers.sh, or beside this Python or on
PATH) and skips with the reason otherwise; .ci/run also runs them as a step of their own."""
import pytest

import outside_checkers


@pytest.mark.parametrize("checker", outside_checkers.CHECKERS)
def test_the_checker_passes_the_pack(checker):
    verdict = outside_checkers.run(checkers=(checker,))[checker]
    if isinstance(verdict, str):
        pytest.skip(verdict)
    assert verdict.passed, f"{verdict.line}\n{verdict.report}"
