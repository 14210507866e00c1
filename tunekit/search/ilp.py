"""A small builder for mixed-integer linear programs, solved by HiGHS through ``scipy.optimize.milp``.

Models are written row by row (``x[3] + 2 x[7] <= 5``) rather than as dense
matrices: :class:`MilpModel` collects variables with bounds and integrality,
sparse constraint rows and a linear objective, and :meth:`MilpModel.solve`
hands them to ``milp`` with a time limit and a target relative gap, returning
a :class:`MilpSolution` that always says how good the answer is (the
incumbent, the proven lower bound and the gap between them).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["MilpModel", "MilpSolution"]

INF = math.inf


@dataclass
class MilpSolution:
    """What the solver returned, with its proof of quality."""

    status: str
    """``optimal`` (within the requested gap), ``limit`` (time or node limit hit,
    ``x`` holds the best solution found if any), ``infeasible``, ``unbounded`` or ``error``."""
    x: np.ndarray | None
    """Variable values of the best solution found (None when there is none)."""
    objective: float | None
    """Objective value of ``x`` (minimised)."""
    bound: float | None
    """Proven lower bound on the optimal objective."""
    gap: float | None
    """``(objective - bound) / objective``; 0 for a proven optimum."""
    time_s: float
    """Wall time of the solve."""
    nodes: int | None
    """Branch-and-bound nodes explored."""
    message: str = ""

    @property
    def has_solution(self) -> bool:
        return self.x is not None


class MilpModel:
    """Variables, sparse rows ``lb <= a.x <= ub`` and a linear objective to minimise."""

    def __init__(self) -> None:
        self._lb: list[float] = []
        self._ub: list[float] = []
        self._integer: list[bool] = []
        self._names: list[str] = []
        self._rows: list[tuple[list[int], list[float], float, float]] = []
        self._objective: dict[int, float] = {}

    # -- variables ----------------------------------------------------------------------

    @property
    def num_vars(self) -> int:
        return len(self._lb)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def num_integer(self) -> int:
        return sum(self._integer)

    def var(self, name: str = "", lb: float = 0.0, ub: float = INF, integer: bool = False) -> int:
        """Add one variable; return its index."""
        if lb > ub:
            raise ValueError(f"variable {name!r}: lower bound {lb} above upper bound {ub}")
        self._lb.append(float(lb))
        self._ub.append(float(ub))
        self._integer.append(bool(integer))
        self._names.append(name)
        return len(self._lb) - 1

    def binary(self, name: str = "") -> int:
        return self.var(name, 0.0, 1.0, integer=True)

    def name(self, index: int) -> str:
        return self._names[index]

    def bounds(self, index: int) -> tuple[float, float]:
        return self._lb[index], self._ub[index]

    def fix(self, index: int, value: float) -> None:
        """Fix a variable to ``value`` (tightens both bounds)."""
        self._lb[index] = self._ub[index] = float(value)

    # -- rows -------------------------------------------------------------------------

    def row(
        self,
        coeffs: Mapping[int, float] | Iterable[tuple[int, float]],
        lb: float = -INF,
        ub: float = INF,
    ) -> None:
        """Add ``lb <= sum(c * x[i]) <= ub``; repeated indices are summed, zeros dropped."""
        items = coeffs.items() if isinstance(coeffs, Mapping) else coeffs
        merged: dict[int, float] = {}
        for i, c in items:
            merged[i] = merged.get(i, 0.0) + float(c)
        idx = [i for i, c in merged.items() if c != 0.0]
        if not idx:
            if lb > 1e-12 or ub < -1e-12:
                raise ValueError(f"an empty row {lb} <= 0 <= {ub} can never hold")
            return
        self._rows.append((idx, [merged[i] for i in idx], float(lb), float(ub)))

    def ge(self, coeffs, rhs: float) -> None:
        self.row(coeffs, lb=rhs)

    def le(self, coeffs, rhs: float) -> None:
        self.row(coeffs, ub=rhs)

    def eq(self, coeffs, rhs: float) -> None:
        self.row(coeffs, lb=rhs, ub=rhs)

    def minimise(self, coeffs: Mapping[int, float]) -> None:
        self._objective = {int(i): float(c) for i, c in coeffs.items()}

    # -- solve --------------------------------------------------------------------------

    def solve(
        self,
        *,
        time_limit: float | None = None,
        mip_rel_gap: float = 1e-4,
        node_limit: int | None = None,
        presolve: bool = True,
        verbose: bool = False,
    ) -> MilpSolution:
        """Minimise the objective; stop at ``time_limit`` seconds or a relative gap of ``mip_rel_gap``."""
        # SciPy takes 0.3 s to import: only when solving.
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array

        n = self.num_vars
        c = np.zeros(n)
        for i, v in self._objective.items():
            c[i] = v
        constraints = []
        if self._rows:
            data, rows, cols, lbs, ubs = [], [], [], [], []
            for r, (idx, vals, lb, ub) in enumerate(self._rows):
                rows.extend([r] * len(idx))
                cols.extend(idx)
                data.extend(vals)
                lbs.append(lb)
                ubs.append(ub)
            a = csr_array((data, (rows, cols)), shape=(len(self._rows), n))
            constraints.append(LinearConstraint(a, np.array(lbs), np.array(ubs)))
        options: dict = {"disp": verbose, "presolve": presolve, "mip_rel_gap": mip_rel_gap}
        if time_limit is not None:
            options["time_limit"] = float(time_limit)
        if node_limit is not None:
            options["node_limit"] = int(node_limit)
        start = time.perf_counter()
        with contextlib.nullcontext() if verbose else native_stdout_silenced():
            res = milp(
                c,
                integrality=np.array(self._integer, dtype=np.uint8),
                bounds=Bounds(np.array(self._lb), np.array(self._ub)),
                constraints=constraints,
                options=options,
            )
        elapsed = time.perf_counter() - start
        status = {0: "optimal", 1: "limit", 2: "infeasible", 3: "unbounded"}.get(
            res.status, "error"
        )
        x = None if res.x is None else np.asarray(res.x)
        objective = None if x is None else float(c @ x)
        bound = getattr(res, "mip_dual_bound", None)
        gap = getattr(res, "mip_gap", None)
        if objective is not None and bound is not None and gap is None:
            gap = (objective - bound) / abs(objective) if objective else 0.0
        return MilpSolution(
            status=status,
            x=x,
            objective=objective,
            bound=None if bound is None else float(bound),
            gap=None if gap is None else max(0.0, float(gap)),
            time_s=elapsed,
            nodes=getattr(res, "mip_node_count", None),
            message=str(res.message),
        )


_SILENCE = threading.Lock()


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """File descriptor 1 points at /dev/null for the duration (C code's ``printf`` included).

    HiGHS prints debugging lines ("HighsMipSolverData::transformNewIntegerFeasibleSolution
    tmpSolver.run();") with ``printf`` whatever ``disp`` says; they would land in
    tunekit's own output. C's buffered stdout is flushed before the descriptor is
    restored, so nothing written meanwhile comes out later either.
    """
    with _SILENCE:  # two solves in two threads: one saved descriptor at a time
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):  # no stdout, or a closed one
            pass
        try:
            saved = os.dup(1)
        except OSError:  # no descriptor 1 to silence
            yield
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        try:
            yield
        finally:
            _flush_c_stdout()
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdout() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to flush (not POSIX)
        pass
