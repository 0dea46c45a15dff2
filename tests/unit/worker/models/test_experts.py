"""experts.py's two ways of running a step's rows through their experts, and which one a step takes.
(The whole layer against transformers is in test_llama_family.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.models import experts
from services.worker.models.experts import (
    GROUPED_MM_ROWS_PER_EXPERT,
    expert_rows,
    grouped_mm_rows,
    per_expert_rows,
)

NUM_EXPERTS = 8


def make_rows(num_rows: int, *, d_ff: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rows [num_rows, 64]`, their experts sorted ascending (some experts chosen by no row), and
    random stacked weights for `NUM_EXPERTS` experts of `d_ff`."""
    g = torch.Generator().manual_seed(seed)
    by_expert = torch.randint(0, NUM_EXPERTS // 2, (num_rows,), generator=g).mul(2).sort().values
    rows = torch.randn(num_rows, 64, generator=g).to(dtype)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * d_ff, 64, generator=g) * 0.1).to(dtype)
    down = (torch.randn(NUM_EXPERTS, 64, d_ff, generator=g) * 0.1).to(dtype)
    return rows, by_expert, gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 5, 40])
def test_the_grouped_matmuls_give_the_loops_values(dtype, num_rows):
    """Both ways run each row through its own expert's matmuls; on this box's CPU they even agree bit for bit.
    Checked within the dtype's rounding, not bit for bit: another CPU's BLAS may order a dot product's sums
    differently in the two kernels (no test may depend on one CPU's float results). A row sent to a wrong
    expert would be off by O(1)."""
    args = (*make_rows(num_rows, dtype=dtype), F.silu)
    torch.testing.assert_close(grouped_mm_rows(*args), per_expert_rows(*args))


def taken_way(monkeypatch, num_rows: int, **rows) -> str:
    taken: list[str] = []

    def spy(name: str):
        way = getattr(experts, name)

        def counted(*args):
            taken.append(name)
            return way(*args)
        return counted

    for name in ("grouped_mm_rows", "per_expert_rows"):
        monkeypatch.setattr(experts, name, spy(name))
    expert_rows(*make_rows(num_rows, **rows), F.silu)
    return taken[0]


def test_a_step_with_few_rows_an_expert_loops_and_one_with_more_runs_grouped_matmuls(monkeypatch):
    threshold = int(GROUPED_MM_ROWS_PER_EXPERT * NUM_EXPERTS)
    assert taken_way(monkeypatch, threshold - 1) == "per_expert_rows"
    assert taken_way(monkeypatch, threshold) == "grouped_mm_rows"


def test_a_d_ff_grouped_mm_cannot_stride_loops_at_any_number_of_rows(monkeypatch):
    """grouped_mm wants each row's stride a multiple of 16 bytes: a d_ff of 6 float32s (24 bytes) is not."""
    assert taken_way(monkeypatch, 40, d_ff=6) == "per_expert_rows"
    assert taken_way(monkeypatch, 40, d_ff=8) == "grouped_mm_rows"
