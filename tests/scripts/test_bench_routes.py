"""scripts/bench_routes.py runs every per-step matmul route of the compiled kernels and names the measured one."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import require_kernels


def test_every_route_is_timed_beside_the_measured_choice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require_kernels()
    import bench_routes

    argv = ["bench_routes.py", "--sizes", "4x9x6x8", "--norms", "layer,batch", "--repeats", "1", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_routes.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| lstm")]
    assert [row.split("|")[1].strip() for row in rows] == ["lstm 4x9x6x8, layer", "lstm 4x9x6x8, batch"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 2 + len(bench_routes.ROUTES) + 1
        forward, backward = cells[-1].split("; ")
        assert {forward, backward} <= set(bench_routes.ROUTES)  # 9 rows: every route may be chosen
