"""HiGHS's own printing never reaches tunekit's output (issue 19, item 16)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_a_solve_prints_nothing_and_what_is_printed_around_it_stays():
    # disp=True makes HiGHS print its whole log with printf: the loudest it can be.
    out = run(
        """
        import numpy as np
        from scipy.optimize import LinearConstraint, milp
        from tunekit.search.ilp import MilpModel, native_stdout_silenced

        print("before", flush=True)
        with native_stdout_silenced():
            res = milp(np.array([-1.0, -2.0]), integrality=np.ones(2),
                       constraints=[LinearConstraint(np.array([[1.0, 1.0]]), 0, 3.5)],
                       options={"disp": True})
            print("python inside")
        print("after", res.status)

        m = MilpModel()
        x = [m.var(f"x{i}", 0, 5, integer=True) for i in range(3)]
        m.le({x[0]: 1, x[1]: 1, x[2]: 1}, 7)
        m.minimise({x[0]: -3, x[1]: -2, x[2]: -1})
        print(m.solve().status)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before", "after", "0", "optimal"]


def test_verbose_solves_still_print():
    out = run(
        """
        from tunekit.search.ilp import MilpModel
        m = MilpModel()
        x = m.var("x", 0, 5, integer=True)
        m.minimise({x: -1})
        m.solve(verbose=True)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "HiGHS" in out.stdout or "Running" in out.stdout
