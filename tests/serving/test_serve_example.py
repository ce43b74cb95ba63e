"""examples/serve.py end to end with tiny settings: every request of the long-tail
workload gets exactly its token budget, in continuous and in static batching; the memory
summary is consistent (pages held per token at least 1, below the dense cache's slots
per token; the paged pool's peak below the dense cache's bytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "serve.py"


def _load():
    return load_script(SCRIPT, "_example_serve")


def test_long_tail_workload_lengths_are_clipped_log_normal_draws():
    serve = _load()
    reqs = serve.long_tail_requests(400, vocab_size=50, seed=1, prompt_median=20,
                                    output_median=10, max_prompt=64, max_output=32)
    plen = [len(r.prompt) for r in reqs]
    olen = [r.max_new_tokens for r in reqs]
    assert 1 <= min(plen) and max(plen) <= 64 and 1 <= min(olen) and max(olen) <= 32
    assert 16 <= sorted(plen)[200] <= 24 and 8 <= sorted(olen)[200] <= 12  # the medians
    assert max(plen) > 3 * 20  # a long tail
    assert sum(r.temperature == 0 for r in reqs) == 134  # every third greedy


@pytest.mark.slow  # a subprocess that compiles two models (~15 s of CPU)
def test_serve_example_serves_every_request_its_budget(tmp_path):
    out = tmp_path / "summary.json"
    args = ["--requests", "10", "--slots", "3", "--page-size", "4", "--max-len", "48",
            "--prompt-median", "6", "--output-median", "5", "--max-prompt", "24",
            "--max-output", "24", "--prefill-chunk", "8", "--d-model", "16", "--layers", "1",
            "--heads", "2", "--kv-heads", "1", "--vocab", "32", "--compare-static",
            "--no-progress", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuous / static tokens/s" in proc.stdout
    res = json.loads(out.read_text())
    serve = _load()
    budget = sum(r.max_new_tokens for r in serve.long_tail_requests(
        10, vocab_size=32, prompt_median=6, output_median=5, max_prompt=24, max_output=24))
    for schedule in ("continuous", "static"):
        s = res[schedule]
        assert s["requests"] == 10 and s["generated_tokens"] == budget
        assert 1.0 <= s["pages_per_token_held"] < s["dense_slots_per_token_held"]
        assert 0 < s["peak_pages"] <= s["num_pages"]
        assert s["peak_kv_mib_paged"] < s["kv_mib_dense"]  # a pool of 18 pages of 4 < 3 x 48
        assert s["ttft_median_s"] <= s["ttft_p90_s"]
    assert res["continuous"]["decode_steps"] <= res["static"]["decode_steps"]


def test_serve_example_streams_stops_and_cancels():
    """The example's streaming consumer with stop tokens and ``cancel_after=2``: each
    request gets the tokens it gets from ``engine.run`` without stop tokens, cut after its
    first stop token (kept), and every fifth request still running after 2 tokens ends
    cancelled with exactly those 2; every page is back in the pool."""
    from jaxpos.serving import PagedDecoder, ServingEngine

    serve = _load()
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         seed=0)
    sizes = dict(prompt_median=6, output_median=5, max_prompt=24, max_output=24)
    eng = ServingEngine(model, num_slots=3, num_pages=18, page_size=4, max_len=48,
                        prefill_chunk=8)
    free = {c.request.id: c.tokens
            for c in eng.run(serve.long_tail_requests(10, vocab_size=32, **sizes))[0]}
    stops = sorted({free[i][2] for i in (1, 2, 3) if len(free[i]) > 3})  # some end early
    reqs = serve.long_tail_requests(10, vocab_size=32, stop_token_ids=stops, **sizes)
    done, stats = serve.serve(eng, reqs, progress=False, label="t", cancel_after=2)
    got = {c.request.id: c for c in done}
    assert sorted(got) == list(range(10))
    for i, c in got.items():
        first = next((j for j, t in enumerate(free[i]) if t in stops), None)
        want = free[i] if first is None else free[i][:first + 1]
        if i % 5 == 0 and len(want) > 2:  # still running after 2 tokens: cancelled
            assert (c.tokens, c.finish_reason) == (want[:2], "cancelled")
        elif first is None:
            assert (c.tokens, c.finish_reason) == (want, "length")
        else:
            assert (c.tokens, c.finish_reason, c.stop_reason) == (want, "stop", want[-1])
    assert stats.generated == sum(len(c.tokens) for c in done)
    reasons = [c.finish_reason for c in done]
    assert min(reasons.count(r) for r in ("stop", "length", "cancelled")) >= 1  # exercised
    summary = serve.summarize(done, stats, eng, model)
    assert [summary[k] for k in ("ended_on_budget", "ended_on_stop_token", "cancelled")] == [
        reasons.count(r) for r in ("length", "stop", "cancelled")]
    assert eng.allocator.in_use == 0 and eng.allocator.reserved == 0
