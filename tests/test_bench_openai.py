"""The ``openai`` benchmark suite's pieces that need no server: its page sections, its wrk
script and its summary of streamed answers."""

from __future__ import annotations

import json
from pathlib import Path

from bench import openai_features as bench
from bench import results
from bench.clients import wrk
from bench.clients.sse import Stream


def test_write_section_replaces_between_its_markers_and_appends_when_absent(
    tmp_path: Path,
) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        f"# Page\n\n{results.MARK.format('a')}\nold\n{results.END.format('a')}\n\ntail\n"
    )
    results.write_section(doc, "a", "new\nlines")
    results.write_section(doc, "b", "other")
    text = doc.read_text()
    assert "old" not in text and "new\nlines" in text and text.index("tail") > text.index("new")
    assert text.rstrip().endswith(f"{results.MARK.format('b')}\nother\n{results.END.format('b')}")
    results.write_section(doc, "a", "again")
    assert doc.read_text().count(results.MARK.format("a")) == 1 and "again" in doc.read_text()
    # the openai suite's sections keep the page's existing markers
    assert results.MARK.format("openai: structured") == "<!-- bench openai: structured -->"


def test_rotating_script_holds_every_body_once() -> None:
    bodies = [bench.v1_body(t) for t in ("one ]] two", "three")]
    script = wrk.lua_script(bodies[0], rotate=bodies)
    assert "request = function()" in script and "i % #bodies + 1" in script
    assert "]=]" in script  # (a longer bracket: a body holds "]]")
    for body in bodies:
        assert body.decode() in script


def test_summary_counts_usage_tokens_and_valid_schema_answers() -> None:
    answer = {**bench.ANSWER}
    good = Stream(sent=0.0, chunks=[0.1, 0.2], completion_tokens=40, finish_reason="stop",
                  text=json.dumps(answer))  # fmt: skip
    bad = Stream(sent=0.0, chunks=[0.1], completion_tokens=12, finish_reason="stop", text="{}")
    cut = Stream(sent=0.0, chunks=[0.1], completion_tokens=64, finish_reason="length", text="{")
    row = bench.summarize([good, bad, cut], 2.0, constrained=True)
    assert row["tokens"] == 116 and row["tok_s"] == 58.0
    assert (row["ended"], row["ended_valid"], row["cut_at_max_tokens"]) == (2, 1, 1)
