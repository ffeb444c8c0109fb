"""Per-request rules a user reads off the outputs: each request's own number of top
logprobs in a shared batch, min_tokens keeping every stop id out of the first tokens, an
abort of a request still waiting, and the time per output token in the metrics."""

from __future__ import annotations

from server_helpers import make_engine, model_fixture, tokenizer_fixture  # noqa: F401 - fixtures

from kvforge.engine.outputs import RequestMetricsReport
from kvforge.engine.request import Request
from kvforge.engine.sampling import SamplingParams


def finish_all(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_each_request_gets_its_own_number_of_top_logprobs_in_a_batch(model, tokenizer):
    engine = make_engine(model, tokenizer)
    counts = {engine.add_request(tokenizer.encode(prompt), SamplingParams(
        max_tokens=4, temperature=temperature, seed=1, logprobs=True, top_logprobs=count)): count
        for prompt, temperature, count in (("abc", 0.0, 1), ("hello", 1.0, 4), ("xyz", 0.0, 0))}
    outputs = finish_all(engine)
    assert engine.steps == 4  # all three ran in every step
    for request_id, count in counts.items():
        final = outputs[request_id][-1]
        if count == 0:
            assert final.top_logprobs is None
        else:
            assert len(final.top_logprobs) == 4
            assert all(len(top) == count for top in final.top_logprobs), f"top_logprobs={count}"


def test_min_tokens_keeps_every_stop_id_out_of_the_first_tokens(model, tokenizer):
    """The stop ids are the 8 most likely ids at each step of the free greedy run, so the
    model wants one of them at nearly every step: only the ban keeps them out until
    min_tokens tokens exist."""
    prompt = tokenizer.encode("xyz")
    engine = make_engine(model, tokenizer)
    engine.add_request(prompt, SamplingParams.greedy_params(12, ignore_eos=True, logprobs=True, top_logprobs=8))
    (free,) = finish_all(engine).values()
    stop_ids = sorted({token for top in free[-1].top_logprobs for token, _ in top})
    for min_tokens in (1, 3, 6):
        engine = make_engine(model, tokenizer)
        engine.add_request(prompt, SamplingParams.greedy_params(12, min_tokens=min_tokens, stop_token_ids=stop_ids))
        (outputs,) = finish_all(engine).values()
        tokens = outputs[-1].token_ids
        assert not set(tokens[:min_tokens]) & set(stop_ids), f"min_tokens={min_tokens}: {tokens}"
        assert tokens[-1] in stop_ids and outputs[-1].finish_reason == "stop"


def test_aborting_a_waiting_request_finishes_it_before_it_runs(model, tokenizer):
    engine = make_engine(model, tokenizer, max_num_seqs=1)
    running = engine.add_request(tokenizer.encode("abc"), SamplingParams.greedy_params(5, ignore_eos=True))
    waiting = engine.add_request(tokenizer.encode("xyz"), SamplingParams.greedy_params(5, ignore_eos=True))
    (first,) = engine.step()
    assert first.request_id == running
    aborted = engine.abort_request(waiting)
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in aborted] == [(waiting, "abort", [])]
    outputs = finish_all(engine)
    assert list(outputs) == [running] and len(outputs[running][-1].token_ids) == 5


def test_time_per_output_token_is_the_mean_gap_between_later_tokens():
    request = Request("r", 0, [1, 2, 3], SamplingParams(max_tokens=8))
    request.output_token_ids = [5, 6, 7, 8, 9]
    request.metrics.arrival_time = 10.0
    request.metrics.first_token_time = 12.0
    request.metrics.finish_time = 20.0
    report = RequestMetricsReport.of(request)
    assert report.time_to_first_token == 2.0 and report.latency == 10.0
    assert report.time_per_output_token == 2.0  # 8 s over the 4 tokens after the first
    assert (report.prompt_tokens, report.output_tokens) == (3, 5)
