"""How decode_linear picks its blocks, and which projections take it (kernels/triton/decode_linear.py)."""

import torch

from freetoken.kernels.triton import decode_linear as dl


def test_one_row_takes_whole_weight_rows_in_one_block():
    # q/k/v of qwen3-30b-a3b ([5120, 2048]) and its output projection ([2048, 4096]): 16 KB tiles,
    # so each program can load its tile before the PDL wait
    assert dl.blocks_for(1, 5120, 2048) == (4, 2048, 4)
    assert dl.blocks_for(1, 2048, 4096) == (2, 4096, 4)
    # a router's 128 rows: one row a program keeps 128 programs (the measured choice)
    assert dl.blocks_for(1, 128, 2048) == dl.BLOCKS[1]
    # wider than ONE_ROW_MAX_K: the table's block, looped over K
    assert dl.blocks_for(1, 512, 6144) == (1, 2048, 4)


def test_more_rows_keep_the_measured_table():
    assert dl.blocks_for(4, 5120, 2048) == dl.BLOCKS[4]
    assert dl.blocks_for(3, 128, 2048) == dl.BLOCKS[4]
    assert dl.blocks_for(2, 128, 2048) == dl.BLOCKS[2]


def test_projection_runs_one_row_here_and_more_rows_on_cublas(monkeypatch):
    calls = []
    monkeypatch.setattr(dl, "decode_linear", lambda x, w, b=None: calls.append(x.shape) or x @ w.T)
    w = torch.randn(8, 16)
    dl.projection(torch.randn(1, 16), w)
    assert calls == [torch.Size([1, 16])]
    out = dl.projection(torch.randn(2, 16), w)
    assert calls == [torch.Size([1, 16])] and out.shape == (2, 8)
    dl.projection(torch.randn(1, 16), w.T.contiguous().T)  # a strided weight: cuBLAS
    assert len(calls) == 1
