"""A captured decode step of a linear-attention model, without the capture: the step's inputs
from the pinned buffer (engine/step_inputs.py), its batch padded up the way DecodeGraphs pads
it, through the code a graph captures, on CPU (the twins).

Checked: the real rows' logits and the whole recurrent-state pool equal an eager, unpadded step's;
padding rows compute row 0's logits and write no state (their slot is read-only, -(s + 1)); and
bad state slots are refused before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.decode_graphs import key_bucket
from freetoken.engine.model_runner import ModelRunner
from freetoken.engine.step_inputs import StepInputs
from freetoken.loader.synth import write_synthetic_checkpoint

PROMPTS = [[5, 9, 300, 12, 7, 7, 81], [40, 41, 42], [200, 199, 198, 197, 196]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("m") / "q35", "qwen3_5_moe", "tiny", seed=5)
    runner = ModelRunner(str(path), EngineConfig(device="cpu", dtype="float32", max_model_len=64), rows=4)
    yield runner
    runner.close()


def _prefilled(runner) -> tuple[list[int], list[int], list[int]]:
    """The three prompts prefilled into rows 0-2, in slots taken out of order -> (slots, last tokens, positions)."""
    slots = [runner.states.acquire() for _ in range(4)]
    runner.states.release(slots[0])  # slot 0 stays free: the padding must not write it either
    slots = slots[:0:-1]  # 3, 2, 1
    last = [int(runner.prefill(runner.row_pages(r), p, state_slot=s)[0].argmax())
            for r, (p, s) in enumerate(zip(PROMPTS, slots, strict=True))]
    return slots, last, [len(p) for p in PROMPTS]


def test_padded_step_equals_the_eager_step(runner):
    slots, last, positions = _prefilled(runner)
    before = (runner.states.conv.clone(), runner.states.ssm.clone())
    tables = [runner.row_pages(r) for r in range(3)]
    want = runner.decode(tables, last, positions, slots)
    want_state = (runner.states.conv.clone(), runner.states.ssm.clone())

    runner.states.conv.copy_(before[0])
    runner.states.ssm.copy_(before[1])
    rows, bucket = 4, key_bucket(max(positions) + 1)
    inputs = StepInputs(rows, bucket, "cpu")
    inputs.fill(last + last[:1], positions + positions[:1], tables + tables[:1], runner.cache.page_size, slots)
    assert inputs.state_slots.tolist() == [0] * 4 and inputs.state_rows.tolist() == [0] * 4  # (not yet uploaded)
    inputs.upload()
    assert inputs.state_slots.tolist() == slots + [-slots[0] - 1] and inputs.state_rows.tolist() == [0, 1, 2, 0]
    got = runner.model.forward(inputs.tokens, inputs.positions, inputs.kv_view(runner.cache, runner.states), bucket)

    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    # (the dense GEMMs may round a row by its place in the batch: not bit for bit)
    torch.testing.assert_close(got[3], got[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.states.conv, want_state[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(runner.states.ssm, want_state[1], rtol=1e-6, atol=1e-6)
    assert (runner.states.ssm[:, 0] == 0).all() and (runner.states.conv[:, 0] == 0).all()
    for s in slots:
        runner.states.release(s)


def test_one_row_takes_its_own_output(runner):
    inputs = StepInputs(1, 128, "cpu")
    inputs.fill([7], [3], [[0]], runner.cache.page_size, [2])
    inputs.upload()
    kv = inputs.kv_view(runner.cache, runner.states)
    assert kv.state_rows is None and kv.state_slots.tolist() == [2]
    assert inputs.kv_view(runner.cache).states is None  # (a model without linear-attention layers)


@pytest.mark.parametrize("slots", [[], [0, 1, 2], [-1], [1, -2]])
def test_bad_state_slots_are_refused(slots):
    inputs = StepInputs(2, 128, "cpu")
    with pytest.raises(ValueError, match="state slots"):
        inputs.fill([7, 7], [3, 3], [[0], [0]], 16, slots)
