"""tools.serving.prefill and its pieces: prompts fitted to exact token counts (a tiny
byte-level BPE tokenizer and SmolLM2's shape of chat template), the measurement loop and
the ITL windows against fake systems, the figures, targets and JSON keys, the options;
and (slow) the whole run on a real local cluster of the tiny model, both layouts."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from tools.harness.load import RequestRecord, read_event
from tools.serving.prefill import (
    Plan,
    checked,
    conversation,
    main,
    measure_itl,
    measure_lengths,
    parse_layouts,
)
from tools.serving.prefill_prompts import (
    PromptBook,
    first_turn,
    fit_text,
    fixed_part,
    follow_up_floor,
    follow_up_turn,
)
from tools.serving.prefill_report import (
    Samples,
    figures,
    gap_stats,
    itl_figures,
    layout_result,
    overlapping_gaps,
    print_report,
    report,
    targets,
)
from tools.serving.prefill_systems import ItlRun


def record_of(start: float, times: Sequence[float] = (), tokens: int = 0,
              prompt_tokens: int | None = None, text: str = "",
              error: str = "") -> RequestRecord:
    """A request's record as a system makes it: sent at ``start``, its tokens' times and
    count, the prompt's tokens, what came back, why it failed."""
    return RequestRecord(start=start, chunk_times=list(times), completion_tokens=tokens,
                         prompt_tokens=prompt_tokens, text=text, error=error)


REQUIRED_KEYS = {"ttft_ms", "genai_ttft_ms", "cached_ttft_ms", "genai_cached_ttft_ms",
                 "decode_ratio", "ttft_ratio", "cached_ratio", "itl_ratio", "targets"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny models' tokenizer (a 384-token byte-level BPE) with a chat template."""
    from tools.harness.random_llama import build_tokenizer
    from zctl.engine.tokenizer import ChatTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    tokenizer = ChatTokenizer(out)
    tokenizer.backend_dir = out  # for the tests that copy it
    return tokenizer


# -- prompts of exact token counts ------------------------------------------------------------


def test_fit_text_hits_the_count_and_refuses_what_it_cannot() -> None:
    words = [f"w{i}" for i in range(50)]

    def count(text: str) -> int:  # 3 fixed tokens, two per word, one per pad piece
        return 3 + sum(2 if p.startswith("w") else 1 for p in text.split())

    assert count(fit_text(count, 20, words)) == 20  # 8 words + a pad
    assert fit_text(count, 19, words) == " ".join(words[:8])
    assert fit_text(count, 3, words) == ""
    with pytest.raises(ValueError, match="fixed part"):
        fit_text(count, 2, words)
    with pytest.raises(ValueError, match="not enough text"):
        fit_text(count, 200, words)
    with pytest.raises(ValueError, match="no text of exactly"):
        fit_text(lambda t: 3 + 2 * len(t.split()), 20, words, pads=())


@pytest.mark.parametrize("extra", [0, 1, 2, 37, 150, 301])
def test_first_turns_are_exactly_n_tokens_after_the_template(tokenizer: Any, extra: int) -> None:
    n = fixed_part(tokenizer) + extra
    turn = first_turn(tokenizer, n, f"key/{extra}")
    assert len(tokenizer.encode_chat(turn)) == n
    assert turn == first_turn(tokenizer, n, f"key/{extra}")  # deterministic
    assert [role for role, _ in turn] == ["user"]


def test_prompts_of_different_keys_share_only_the_template_and_header_start(tokenizer: Any) -> None:
    a = tokenizer.encode_chat(first_turn(tokenizer, 300, "shared/chat/0"))
    b = tokenizer.encode_chat(first_turn(tokenizer, 300, "shared/chat/1"))
    c = tokenizer.encode_chat(first_turn(tokenizer, 300, "split/chat/0"))
    template = len(tokenizer.encode_chat([("user", "")])) + 12
    for x, y in ((a, b), (a, c), (b, c)):
        same = next(i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q)
        assert same < template


def test_a_follow_up_turn_appends_exactly_k_tokens_to_prompt_and_answer(tokenizer: Any) -> None:
    first = first_turn(tokenizer, 200, "k")
    answer = "the quick brown fox jumps over the lazy dog"
    for extra in (follow_up_floor(tokenizer) + 4, 32, 60):
        second = follow_up_turn(tokenizer, first, answer, 9, extra)
        ids = tokenizer.encode_chat(second)
        assert len(ids) == 200 + 9 + extra
        assert ids[:200] == tokenizer.encode_chat(first)  # the first turn is a prefix
        assert second[:2] == [*first, ("assistant", answer)] and second[2][0] == "user"


def test_prompts_work_with_smollm2s_template_shape(tokenizer: Any, tmp_path: Path) -> None:
    """A default system turn before the user's (SmolLM2's template adds one)."""
    import shutil

    from zctl.engine.tokenizer import ChatTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer.backend_dir) / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    smol = ChatTokenizer(tmp_path)
    turn = first_turn(smol, 250, "x")
    assert len(smol.encode_chat(turn)) == 250 > len(tokenizer.encode_chat(turn))
    second = follow_up_turn(smol, turn, "an answer of a few words", 6, 32)
    assert len(smol.encode_chat(second)) == 250 + 6 + 32


def test_the_prompt_book_fits_each_prompt_once(tokenizer: Any) -> None:
    book = PromptBook(tokenizer)
    assert book.turn(150, "a") is book.turn(150, "a")
    assert book.turn(150, "a") != book.turn(150, "b") != book.turn(151, "a")


# -- the measurement loop against fake systems ------------------------------------------------


class FakeSystem:
    """Answers a turn of N prompt tokens with a TTFT of N/10 ms (a twentieth for a
    follow-up turn when ``cache``) and ``rate`` tok/s; logs what it was sent."""

    serves_streams = False

    def __init__(self, name: str, tokenizer: Any, cache: bool = False, rate: float = 100.0,
                 wrong_prompt: bool = False, log: list[str] | None = None) -> None:
        self.name, self.tokenizer, self.cache, self.rate = name, tokenizer, cache, rate
        self.wrong_prompt = wrong_prompt
        self.sent: list[tuple[int, int]] = []  # (prompt tokens, max tokens)
        self.log = [] if log is None else log  # (shared) system names, in call order

    def turn(self, messages: list[tuple[str, str]], max_tokens: int) -> RequestRecord:
        n = len(self.tokenizer.encode_chat(list(messages)))
        self.sent.append((n, max_tokens))
        self.log.append(self.name)
        ttft = n / 1e4 / (20 if self.cache and len(messages) > 1 else 1)
        times = [ttft + i / self.rate for i in range(max_tokens)]
        return record_of(0.0, times, max_tokens, n + self.wrong_prompt, " the" * max_tokens)


class FakeStreams(FakeSystem):
    """Serves short streams at once: a token every 10 ms, every 50 ms with a long prompt
    among them (whose first token comes 1 s after it is sent)."""

    serves_streams = True

    def itl_run(self, shorts: Any, short_tokens: int, warm: int, long: Any,
                long_tokens: int) -> ItlRun:
        gap = 0.05 if long is not None else 0.01
        streams = [record_of(0.0, [0.1 + i * gap for i in range(short_tokens)], short_tokens)
                   for _ in shorts]
        run = ItlRun(streams, 0.1 + warm * gap)
        if long is not None:
            run.long = record_of(run.ready, [run.ready + 1.0], 1,
                            len(self.tokenizer.encode_chat(list(long))))
        return run


def test_conversation_sends_the_follow_up_right_after(tokenizer: Any) -> None:
    plan = Plan([200], [200], tokens=4, follow_up=30)
    system = FakeSystem("zctl", tokenizer)
    one, two = conversation(system, PromptBook(tokenizer), plan, 200, "k")
    assert one.ok and two.ok and system.sent == [(200, 4), (200 + 4 + 30, 4)]
    bad = FakeSystem("zctl", tokenizer, wrong_prompt=True)
    one, two = conversation(bad, PromptBook(tokenizer), plan, 200, "k")
    assert one.error == "prompt of 201 tokens, expected 200" and not two.ok
    assert checked(record_of(0.0, prompt_tokens=5), 5).ok


def test_measure_lengths_interleaves_and_keys_by_length(tokenizer: Any) -> None:
    plan = Plan([120, 180], [120, 240], repeats=2, tokens=4, decode_tokens=8, follow_up=30)
    log: list[str] = []
    systems = [FakeStreams("zctl", tokenizer, rate=90.0, log=log),
               FakeSystem("genai", tokenizer, cache=True, rate=100.0, log=log),
               FakeStreams("genai_cb", tokenizer, cache=True, log=log)]
    samples = measure_lengths(plan, systems, PromptBook(tokenizer), "shared")
    assert samples.errors == []
    z = samples.values["zctl"]
    assert set(z) == {"ttft", "cached", "decode"} and len(z["ttft"][120]) == 2
    assert set(z["decode"]) == {120, 240} and 180 not in z["decode"]
    assert "decode" not in samples.values["genai_cb"]  # decode: zctl against the LLMPipeline
    fig = figures(samples, plan.lengths, plan.decode_lengths)
    assert fig["ttft_ms"] == {"120": 12.0, "180": 18.0} and fig["ttft_ratio"]["180"] == 1.0
    assert fig["cached_ratio"]["120"] == 20.0 and fig["decode_ratio"]["240"] == 0.9
    assert set(fig["decode_tok_s"]) == {"120", "240"}
    # each (length, repeat) in turn: zctl first, then genai CB first, and so on
    assert log[:5] == ["zctl"] * 3 + ["genai"] * 2  # 120 tokens: a chat pair and a decode
    assert log[8:12] == ["genai_cb"] * 2 + ["genai"] * 2  # 120 tokens, the second run
    assert [n for n, _ in systems[0].sent].count(120) == 2 + 2  # turn 1s + decode runs


def test_every_measurement_gets_a_prompt_never_sent_before(tokenizer: Any) -> None:
    book = PromptBook(tokenizer)
    plan = Plan([120], [120], repeats=3, tokens=2, decode_tokens=2, follow_up=30)
    system = FakeSystem("genai", tokenizer)
    sent: list[str] = []
    system.turn = lambda m, n: (sent.append(m[0][1]), record_of(0.0, [0.1, 0.2], n, None))[1]
    for layout in ("shared", "split"):
        measure_lengths(plan, [system], book, layout)
    assert len(sent) == 2 * 3 * 3  # layouts x repeats x (turn 1, turn 2, decode)
    assert len(set(sent)) == 2 * 3 * 2  # a follow-up turn opens with its first turn


def test_measure_itl_runs_alone_then_with_the_long_prompt(tokenizer: Any) -> None:
    plan = Plan([120], [120], itl_streams=3, itl_tokens=40, itl_length=150)
    llm = FakeSystem("genai", tokenizer)  # the LLMPipeline serves no streams at once
    assert measure_itl(plan, [llm], PromptBook(tokenizer), "shared") == {}
    out = measure_itl(plan, [FakeStreams("zctl", tokenizer), llm], PromptBook(tokenizer),
                      "shared")
    it = out["zctl"]
    assert it["alone_ms"]["p50"] == pytest.approx(10.0)
    assert it["during_ms"]["p50"] == pytest.approx(50.0)
    assert it["ratio_p99"] == pytest.approx(5.0) and it["streams"] == 3
    assert it["long_prompt_tokens"] == 150 and it["errors"] == []
    assert measure_itl(Plan([120], [120], itl_length=0), [FakeStreams("zctl", tokenizer)],
                       PromptBook(tokenizer), "shared") == {}


# -- inter-token gaps --------------------------------------------------------------------------


def test_overlapping_gaps_count_the_stall_across_the_window_edges() -> None:
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 1.7]
    assert overlapping_gaps(times, 0.25, 1.55) == pytest.approx([1.3, 0.1])
    assert overlapping_gaps(times, 0.15, 0.18) == pytest.approx([0.1])
    assert overlapping_gaps(times, 2.0, 3.0) == []
    assert gap_stats([]) == {"p50": None, "p99": None, "max": None, "gaps": 0}
    assert gap_stats([0.01, 0.03])["max"] == 30.0


def test_itl_figures_compare_the_prefill_window_with_the_streams_alone() -> None:
    def stream(times: list[float]) -> RequestRecord:
        return record_of(0.0, times, len(times))

    alone = ItlRun([stream([0.1 * i for i in range(30)]), stream([0.1 * i for i in range(20)])],
                   ready=0.5)
    during = ItlRun([stream([0.1, 0.2, 0.3, 1.3, 1.4, 1.5]), stream([0.15, 0.25, 0.35])],
                    ready=0.3, long=record_of(0.32, [1.2], 16, 4096))
    it = itl_figures(alone, during)
    assert it["alone_ms"]["gaps"] == 14 + 14  # from ready (0.5) to the first end (1.9)
    assert it["alone_ms"]["p50"] == pytest.approx(100.0)
    # the stall across the window and the gap that ends inside it
    assert it["during_ms"]["gaps"] == 1 + 1 and it["during_ms"]["max"] == pytest.approx(1000.0)
    assert it["ratio_max"] == pytest.approx(10.0)
    assert it["streams_through_prefill"] == 1 and it["long_ttft_ms"] == pytest.approx(880.0)
    assert it["long_prompt_tokens"] == 4096 and it["errors"] == []
    no_long = itl_figures(alone, ItlRun(during.streams, 0.3))
    assert no_long["during_ms"]["gaps"] == 0 and no_long["ratio_p99"] is None


def test_read_event_collects_text_times_and_usage() -> None:
    record = record_of(0.0)
    assert not read_event(record, json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), 1.0)
    assert not read_event(record, json.dumps({"choices": [{"delta": {"content": "Hi"}}]}), 2.0)
    assert not read_event(record, json.dumps({"choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": 3}}), 3.0)
    assert read_event(record, "[DONE]", 4.0)
    assert (record.chunk_times, record.text, record.completion_tokens,
            record.prompt_tokens) == ([2.0], "Hi", 3, 7)
    with pytest.raises(ValueError, match="error in stream"):
        read_event(record, json.dumps({"error": {"message": "context"}}), 5.0)


def test_turn_figures() -> None:
    turn = record_of(1.0, [1.5, 1.6, 1.7, 1.9], 5)
    assert turn.ttft_ms == pytest.approx(500.0) and turn.decode_tok_s == pytest.approx(4 / 0.4)
    assert record_of(1.0, [1.5], 1).decode_tok_s is None
    assert record_of(1.0, [1.5, 2.0], 2, error="x").ttft_ms is None


# -- figures, targets, the JSON ----------------------------------------------------------------


def _layout(ttft: float, cached: float, decode: float, itl: float | None) -> dict[str, Any]:
    samples = Samples()
    lengths, decode_lengths = [256, 1024, 4096], [256, 2048, 4096]
    for n in lengths:
        for system, t, c in (("zctl", ttft, cached), ("genai", 1.0, 1.0), ("genai_cb", 1.0, 1.0)):
            samples.add(system, "ttft", n, record_of(0.0, [n * t / 1e3, 1.0], 2))
            samples.add(system, "cached", n, record_of(0.0, [n * c / 1e3, 1.0], 2))
    for n in decode_lengths:
        for system, rate in (("zctl", decode), ("genai", 1.0)):
            samples.add(system, "decode", n, record_of(0.0, [0.0, 10.0 / rate], 11))
    samples.add("zctl", "ttft", 256, record_of(0.0, error="http 400: too long"))
    if itl is None:
        return layout_result(samples, lengths, decode_lengths, {})
    alone = ItlRun([record_of(0.0, [0.01 * i for i in range(50)], 50)], ready=0.1)
    during = ItlRun([record_of(0.0, [0.01 * itl * i for i in range(50)], 50)], ready=0.1,
                    long=record_of(0.1, [0.4], 16, 4096))
    return layout_result(samples, lengths, decode_lengths, {"zctl": itl_figures(alone, during)})


def test_targets_met_missed_and_not_measured() -> None:
    met = _layout(0.9, 1.9, 0.96, 1.5)
    assert met["ttft_ratio"] == {"256": 0.9, "1024": 0.9, "4096": 0.9}
    assert met["decode_ratio"]["2048"] == 0.96 and met["errors"] == 1
    assert all(t["met"] for t in met["targets"].values())
    assert set(met["targets"]["ttft_cold"]["value"]) == {"1024", "4096"}
    assert set(met["targets"]["decode_at_context"]["value"]) == {"2048", "4096"}
    missed = _layout(1.1, 2.5, 0.9, 3.0)
    assert not any(t["met"] for t in missed["targets"].values())
    fig = {"ttft_ratio": {"256": 0.5}, "cached_ratio": {"256": None}, "decode_ratio": {}}
    assert all(t["met"] is None for t in targets(fig, None).values())


def test_the_report_has_the_keys_at_the_top_and_per_layout() -> None:
    layouts = {"shared": _layout(2.0, 2.0, 0.8, 9.0), "split": _layout(1.5, 1.5, 0.9, 4.0)}
    record = {"cpu": "a CPU [avx2]", "cpus": 2, "date": "2026-12-02T00:00:00+00:00",
              "commit": "abc1234"}
    result = json.loads(json.dumps(report(layouts, record, {"repeats": 1})))
    assert REQUIRED_KEYS <= set(result) and result["layout"] == "shared"
    assert {"cpu", "date", "commit", "layouts", "settings"} <= set(result)
    assert set(result["layouts"]) == {"shared", "split"}
    for lay in result["layouts"].values():
        assert REQUIRED_KEYS <= set(lay)
        assert set(lay["ttft_ms"]) == {"256", "1024", "4096"} == set(lay["cached_ttft_ms"])
        assert set(lay["decode_ratio"]) == {"256", "2048", "4096"}
        assert all(isinstance(t["met"], bool) for t in lay["targets"].values())
    assert result["ttft_ms"] == result["layouts"]["shared"]["ttft_ms"]
    assert result["itl_ratio"] == pytest.approx(9.0) and "samples" not in result
    printed = io.StringIO()
    print_report(result, Console(file=printed, width=250))
    text = printed.getvalue()
    assert "a CPU [avx2]" in text and "split cores" in text and "MISSED" in text
    assert "4096" in text and "2.00x" in text


def test_a_run_without_genai_has_the_keys_with_nothing_measured() -> None:
    samples = Samples()
    samples.add("zctl", "ttft", 256, record_of(0.0, [0.2, 0.3], 2))
    lay = layout_result(samples, [256], [256], {})
    assert lay["genai_ttft_ms"] == {"256": None} and lay["ttft_ratio"] == {"256": None}
    assert lay["decode_ratio"] == {"256": None} and lay["itl_ratio"] is None
    assert all(t["met"] is None for t in lay["targets"].values())


# -- options ----------------------------------------------------------------------------------


def test_layouts_parse_and_refuse() -> None:
    assert parse_layouts("shared,split") == ["shared", "split"]
    assert parse_layouts(" split ") == ["split"]
    for bad in ("", "both", "shared,shared", "shared,foo"):
        with pytest.raises(typer.BadParameter, match="--layouts"):
            parse_layouts(bad)


def test_plan_problems() -> None:
    good = Plan([256, 1024, 1660, 4096], [256, 1024, 1660, 2048, 4096])
    assert good.problem() is None and good.model_problem(55, 11, 8192) is None
    assert good.itl_warm == 16 and Plan([1], [1], itl_tokens=8).itl_warm == 2
    assert "--repeats" in Plan([256], [256], repeats=0).problem()
    assert "--itl-streams" in Plan([256], [256], itl_streams=9).problem()
    assert "--tokens" in Plan([256], [256], tokens=1).problem()
    assert ">= 55" in Plan([40], [256]).model_problem(55, 11, 8192)
    assert "--follow-up" in Plan([256], [256], follow_up=10).model_problem(55, 11, 8192)
    assert "context is 4096" in good.model_problem(55, 11, 4096)
    assert "--decode-lengths" in Plan([256], [8192]).model_problem(55, 11, 8192)
    assert "--itl-length" in Plan([256], [256], itl_length=20).model_problem(55, 11, 8192)


@pytest.mark.parametrize("args,message", [
    (["--lengths", "256,abc"], "--lengths"),
    (["--lengths", "0"], "--lengths"),
    (["--decode-lengths", ""], "--decode-lengths"),
    (["--layouts", "shared,both"], "--layouts"),
    (["--repeats", "0"], "--repeats"),
    (["--itl-streams", "0"], "--itl-streams"),
    (["--weights", "int3"], "--weights"),
])
def test_bad_options_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


# -- the whole run on a real local cluster of the tiny model (no genai) -------------------------


@pytest.mark.e2e
@pytest.mark.serial  # the long prompt must land while the short streams decode
def test_a_tiny_run_on_both_layouts(tiny_llama_dir: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCTL_HOME", str(tmp_path / "cache"))
    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, [
        "--model", str(tiny_llama_dir), "--weights", "fp32", "--skip-genai", "--json",
        "--lengths", "96,140", "--decode-lengths", "96,160", "--repeats", "1",
        "--tokens", "4", "--decode-tokens", "8", "--follow-up", "30",
        "--itl-streams", "2", "--itl-tokens", "96", "--itl-length", "160", "--timeout", "120"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert REQUIRED_KEYS <= set(out) and set(out["layouts"]) == {"shared", "split"}
    for lay in out["layouts"].values():
        assert lay["errors"] == 0, lay["error_list"]
        assert set(lay["ttft_ms"]) == {"96", "140"} and all(lay["ttft_ms"].values())
        assert all(lay["cached_ttft_ms"].values()) and lay["genai_ttft_ms"]["96"] is None
        assert set(lay["decode_tok_s"]) == {"96", "160"} and all(lay["decode_tok_s"].values())
        it = lay["itl"]["zctl"]
        assert it["long_prompt_tokens"] == 160 and it["alone_ms"]["gaps"] > 0
        assert it["during_ms"]["gaps"] > 0 and it["ratio_p99"] is not None
    assert not (tmp_path / "cache" / "bench-prefill" / "home" / "cluster.json").exists()
