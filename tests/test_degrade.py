"""A draft model that cannot load never becomes an outage."""

from __future__ import annotations

import shutil

from conftest import complete, running_engine, tiny_config


async def test_broken_draft_degrades_to_target_only(tiny, tmp_path):
    broken = tmp_path / "broken-draft"
    shutil.copytree(tiny["copy"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    # (prompt sampling rides along: rate 1.0 puts the text on every record)
    config = tiny_config(tiny, draft="copy", n=3).model_copy(
        update={"draft_model": str(broken), "prompt_sample_rate": 1.0}
    )
    async with running_engine(config) as (engine, sink):
        assert engine.degraded_reason and engine.active_config.method == "none"
        assert engine.capacity == 0
        text, ids, rid = await complete(engine, "the model draft", 12, temperature=0.0, ignore_eos=True)
        assert len(ids) == 12
    record = sink.by_id(rid)
    assert record.speculation_method == "none" and not record.speculation_enabled
    assert record.finish_reason == "length" and record.error is None
    assert record.prompt_text == "the model draft" and record.completion_text == text
