"""The OpenAI API tests again, against the real engine on a tiny synthetic checkpoint.

Same tests as test_server_openai.py, test_server_openai_errors.py and test_server_openai_tools.py
(those needing the fake's scripted behaviour skip), so the server and the engine are checked
together over a real socket.
"""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.llm import AsyncLLM
from tests.server_harness import running_server
from tests.test_server_openai import *  # noqa: F403
from tests.test_server_openai_errors import *  # noqa: F403
from tests.test_server_openai_tools import *  # noqa: F403


@pytest.fixture(scope="module")
def srv(make_checkpoint):
    model_dir = make_checkpoint("qwen3_moe", "tiny")
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=512, served_model_name="demo")
    with running_server(lambda: AsyncLLM.start(config)) as s:
        yield s
