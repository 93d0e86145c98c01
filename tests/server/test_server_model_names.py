"""--served-model-name with several names: the server answers to each, lists each, and its responses
carry the first (as vLLM's)."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_testutil import MODEL_NAME, ServerProcess


@pytest.fixture(scope="module")
def aliased(server_ckpt, tmp_path_factory):
    srv = ServerProcess(server_ckpt, tmp_path_factory.mktemp("logs") / "aliased.log",
                        "--served-model-name", MODEL_NAME, "alias-b")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_every_name_is_served_and_listed(aliased):
    c = aliased.client()
    assert [m.id for m in c.models.list().data] == [MODEL_NAME, "alias-b"]
    for name in (MODEL_NAME, "alias-b"):
        r = c.completions.create(model=name, prompt="def f(x):", max_tokens=3, temperature=0)
        assert r.model == MODEL_NAME and len(r.choices[0].text) > 0
        r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.model == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x", max_tokens=2)
    assert httpx.get(aliased.base_url + "/health").status_code == 200
