"""The closing line of `make test` counts the skipped tests by reason."""

from __future__ import annotations


def test_skipped_tests_are_counted_by_reason_in_one_closing_line(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("i", [1, 2])
        def test_needs_a_gpu(i):
            pytest.skip("needs a CUDA device")

        def test_needs_wandb():
            pytest.importorskip("no_such_module_here")

        def test_runs():
            pass
        """)
    result = pytester.runpytest("-p", "skip_summary")
    result.assert_outcomes(passed=1, skipped=3)
    line = [x for x in result.outlines if x.startswith("skipped by reason: ")]
    assert line == ["skipped by reason: 2 x needs a CUDA device | 1 x could not import 'no_such_module_here': "
                    "No module named 'no_such_module_here'"], result.outlines[-8:]
