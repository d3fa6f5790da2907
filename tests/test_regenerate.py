"""`dflash regenerate`: the target's own greedy answers, round trip, multi-turn, skipping, sharding, resume,
and the OpenAI-compatible server backend against a real HTTP server (tests/openai_server.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from openai_server import OpenAIServer

from dflash.cli import main
from dflash.config import load_config
from dflash.data.synthetic import build_tokenizer, generate_conversations
from dflash.errors import BadInput
from dflash.models.target import build_hf_model
from dflash.regenerate import (
    RegenStats,
    SamplingParams,
    TransformersBackend,
    regenerate_conversations,
    strip_thinking,
)
from dflash.regenerate.core import generation_slots
from dflash.regenerate.hf import render_prompt
from dflash.regenerate.server import OpenAIServerBackend, ServerError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
EOS = 3  # <|im_end|> of the synthetic tokenizer


@pytest.fixture(scope="module")
def target():
    """The tiny config's target, built exactly as the trainer builds it (same seed, same weights)."""
    cfg = load_config(TINY, [])
    t = cfg.target
    model = build_hf_model(t.path, t.random_init, t.dtype, t.attn_implementation, seed=cfg.seed).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.runtime.num_threads or 1)  # as the CLI runs it; tiny matmuls gain nothing from more
    yield model, build_tokenizer(cfg.tokenizer.synthetic_vocab_size)
    torch.set_num_threads(threads)


def conversations() -> list[list[dict]]:
    rows = [r["messages"] for r in generate_conversations(9, 64, 4, 10, [1, 2], seed=7)]
    rows.append([{"role": "system", "content": "you are a counter"}, {"role": "user", "content": "count by 1 from w5"},
                 {"role": "assistant", "content": "w5 w6 w7"}, {"role": "user", "content": "count by 2 from w7"},
                 {"role": "assistant", "content": "w7 w9"}])
    rows.append([{"role": "user", "content": "count by 3 from w1"}])  # prompt only: gets an answer
    rows.append([{"role": "user", "content": "count from w9"}, {"role": "assistant", "content": "w9"},
                 {"role": "assistant", "content": "w10"}, {"role": "user", "content": "by 2"}])
    return rows


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, vocab: int) -> list[int]:
    """The target's own greedy continuation, one token at a time, no cache, no batching."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        nxt = int(model(torch.tensor([seq])).logits[0, -1, :vocab].argmax())
        seq.append(nxt)
        if nxt == EOS:
            break
    return seq[len(prompt):]


def tokens(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def check_is_greedy_and_round_trips(model, tok, conv: list[dict], max_new_tokens: int) -> int:
    """Every assistant turn of `conv`, rendered and re-tokenized as the trainer does, holds exactly the
    target's greedy continuation of the (regenerated) history before it. Returns the number of turns."""
    full = tokens(tok, tok.apply_chat_template(conv, tokenize=False))
    turns = 0
    for k, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prefix = tokens(tok, tok.apply_chat_template(conv[:k], tokenize=False, add_generation_prompt=True))
        assert full[:len(prefix)] == prefix
        ref = greedy(model, prefix, max_new_tokens, len(tok))
        assert full[len(prefix):len(prefix) + len(ref)] == ref, f"turn {k}: {m['content']!r}"
        if ref[-1] != EOS:  # cut by max_new_tokens: the template closes the turn
            assert full[len(prefix) + len(ref)] == EOS
        turns += 1
    return turns


# ------------------------------------------------------------------------------------- in-process API
def test_answers_are_the_targets_greedy_continuation_and_round_trip(target):
    model, tok = target
    convs = conversations()
    out, stats = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=4),
                                          SamplingParams(max_new_tokens=12))
    assert isinstance(stats, RegenStats) and stats.prompts == len(convs) and stats.skipped == 0
    assert stats.roundtrip_mismatches == 0 and stats.generated_tokens > 0 and stats.seconds > 0
    turns = sum(check_is_greedy_and_round_trips(model, tok, conv, 12) for conv in out)
    assert turns == stats.turns == sum(generation_slots(c) for c in convs)
    for src, conv in zip(convs, out, strict=True):
        assert [m for m in conv if m["role"] != "assistant"] == [m for m in src if m["role"] != "assistant"]
        assert conv[-1]["role"] == "assistant"
    # multi-turn: the second answer is conditioned on the first *regenerated* answer, not the original
    multi = out[9]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[2]["content"] != "w5 w6 w7"  # (and turn 4 was checked against the greedy run after it)
    # consecutive assistant turns collapse into one answer; a trailing prompt turn is answered
    assert [m["role"] for m in out[11]] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in out[10]] == ["user", "assistant"]


def test_batching_does_not_change_greedy_answers(target):
    model, tok = target
    convs = conversations()[:9]
    params = SamplingParams(max_new_tokens=10)
    one, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=1), params)
    many, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=9), params)
    cont, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batching="continuous"), params)
    assert one == many == cont


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_grouped_query_decode_attention_equals_transformers_sdpa(mask_kind):
    """One query position: the G query heads of a KV head as G rows of that head, no K/V copy; the same
    function as transformers' sdpa (which copies K/V per head), for boolean, additive and no masks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash.regenerate.attention import gqa_decode_sdpa

    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 8, 2, 11, 16
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    q = torch.randn(batch, heads, 1, dim, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    keep[0, ..., :4] = False  # left padding of row 0, unused cache slots of row 1
    keep[1, ..., 9:] = False
    mask = {"bool": keep, "none": None,
            "float": torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
            }[mask_kind]
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    got, _ = gqa_decode_sdpa(module, q, k, v, mask, scaling=dim ** -0.5)
    assert got.shape == want.shape == (batch, 1, heads, dim)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # several query positions (a prompt) take transformers' own path: the same result by construction
    q4 = torch.randn(batch, heads, 4, dim, dtype=torch.float64)
    m4 = None if mask is None else mask.expand(batch, 1, 4, length)
    assert torch.equal(gqa_decode_sdpa(module, q4, k, v, m4)[0], sdpa_attention_forward(module, q4, k, v, m4)[0])


def test_grouped_query_decoding_keeps_answers_and_restores_the_model(target):
    """The backend's decode attention (no K/V copy) gives the same greedy answers as transformers' sdpa, and
    the model's attention implementation is back to sdpa afterwards (the trainer shares the target)."""
    from dflash.regenerate.attention import NAME, grouped_query_decoding

    model, tok = target
    convs = conversations()[:9]
    params = SamplingParams(max_new_tokens=10)
    plain = TransformersBackend(model, tok, batch_size=4)
    plain.gqa_decode = False
    ref, _ = regenerate_conversations(convs, plain, params)
    calls = []
    import dflash.regenerate.attention as attention

    real = attention.gqa_decode_sdpa

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    attention.gqa_decode_sdpa = counting
    try:
        got, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=4), params)
    finally:
        attention.gqa_decode_sdpa = real
    assert got == ref
    assert calls and calls.count(1) > len(calls) // 2  # the decode steps went through it
    assert model.config._attn_implementation == "sdpa"
    with grouped_query_decoding(model) as switched:
        assert switched and model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("stops", [[30], [54, 38]])
def test_refill_batching_gives_the_static_answers(target, stops):
    """batching="refill": once half a batch has finished, the finished rows are answered and replaced, the
    others go on from prompt + generated ids. Extra stop ids give this random target answers of uneven
    lengths; the greedy answers equal static batches' and one-at-a-time decoding."""
    model, tok = target
    convs = conversations()
    params = SamplingParams(max_new_tokens=24)

    def run(batching: str, batch_size: int):
        backend = TransformersBackend(model, tok, batch_size=batch_size, batching=batching)
        backend.stop_ids = list(stops)
        widths, real = [], backend._generate_static

        def spy(prompts, *args, **kwargs):
            widths.append(max(len(p) for p in prompts))
            return real(prompts, *args, **kwargs)

        backend._generate_static = spy
        out, stats = regenerate_conversations(convs, backend, params)
        return out, stats, widths

    ref, ref_stats, _ = run("static", 1)
    assert 0 < ref_stats.hit_max_new_tokens < ref_stats.turns  # uneven: some answers stop early, some do not
    for batch_size in (2, 3):
        out, stats, widths = run("refill", batch_size)
        assert out == ref and stats.generated_tokens == ref_stats.generated_tokens
        assert len(widths) > -(-ref_stats.turns // batch_size)  # rows went on in later rounds: refills happened
    assert run("static", 4)[0] == ref


def test_too_long_prompts_are_skipped_and_counted(target):
    model, tok = target
    short = [{"role": "user", "content": "count by 1 from w1"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "w1 " * 30}]
    long = [{"role": "user", "content": "w2 " * 40}]
    ok = [{"role": "user", "content": "count by 2 from w3"}]
    params = SamplingParams(max_new_tokens=6, max_prompt_tokens=20)
    out, stats = regenerate_conversations([short, long, ok], TransformersBackend(model, tok), params)
    assert out[1] is None and stats.skipped == 1 and stats.skipped_indices == [1]
    assert out[0] is not None and len(out[0]) == 2 and stats.truncated == 1  # kept up to its last fitting answer
    assert out[2] is not None and stats.turns == 2
    # default limit: the target's max positions (512) minus max_new_tokens
    backend = TransformersBackend(model, tok)
    assert backend.prompt_limit(SamplingParams(max_new_tokens=500)) == 12
    assert backend.prompt_limit(SamplingParams(max_new_tokens=500, max_prompt_tokens=100)) == 100
    with pytest.raises(BadInput, match="no room for a prompt"):
        backend.prompt_limit(SamplingParams(max_new_tokens=512))


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(target):
    model, tok = target
    convs = conversations()[:6]
    params = SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=3)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=3), params)
    assert torch.equal(torch.random.get_rng_state(), before)
    b, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=3), params)
    c, _ = regenerate_conversations(convs, TransformersBackend(model, tok, batch_size=3), SamplingParams(
        max_new_tokens=8, temperature=1.5, top_p=0.95, seed=4))
    assert a == b and a != c


def test_thinking_modes():
    assert strip_thinking("<think>\nlet me see\n</think>\n\nthe answer") == "the answer"
    assert strip_thinking("reasoning whose opening tag sat in the prompt</think>\nanswer") == "answer"
    assert strip_thinking("<think>cut by max_new_tokens") == ""
    assert strip_thinking("plain") == "plain"
    tok = build_tokenizer(64)
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                         "{% if enable_thinking is defined and not enable_thinking %}you are {% endif %}{% endif %}")
    conv = [{"role": "user", "content": "count"}]
    keep = render_prompt(tok, conv, SamplingParams(thinking="keep"))
    off = render_prompt(tok, conv, SamplingParams(thinking="disable"))
    assert off == keep + tokens(tok, "you are")


# ---------------------------------------------------------------------------------------------- CLI
def write_rows(path: Path, rows: list) -> Path:
    """JSON rows; a str row is written as is (latin-1: a byte that is not UTF-8 stays one byte)."""
    path.write_bytes(b"".join((r.encode("latin-1") if isinstance(r, str) else json.dumps(r).encode()) + b"\n"
                              for r in rows))
    return path


def regen(tmp_path: Path, inp: Path, out: Path, *extra: str) -> int:
    return main(["regenerate", str(inp), str(out), "--target-config", str(TINY), "--max-new-tokens", "8",
                 *extra])


@pytest.mark.parametrize("row, message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "malformed JSON"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role 'wizard'"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "no prompt turn"),
    ({"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]}, "before any prompt turn"),
    ({"text": "hi"}, "no 'messages'"),
    ('{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8"),
])
def test_a_bad_data_row_exits_3_naming_the_line_and_writes_nothing(tmp_path, capsys, row, message):
    """A data error (dflash/runtime/failures.py: data_error, exit 3), never restarted."""
    good = {"messages": [{"role": "user", "content": "count by 1 from w1"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "count"}, {"from": "gpt", "value": "w1"}]}
    inp = write_rows(tmp_path / "in.jsonl", [good, sharegpt, row, good])
    out = tmp_path / "out" / "regen.jsonl"
    assert regen(tmp_path, inp, out) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash: error: ") and f"{inp}:3: " in err[0] and message in err[0]
    assert not (tmp_path / "out").exists()


def test_input_rows_keep_their_line_numbers(tmp_path):
    from dflash.regenerate.files import read_conversations

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "a"}]}\n\n'
                    b'{"conversations": [{"from": "human", "value": "b"}]}\n')  # a BOM and a blank line
    convs, lines = read_conversations(inp)
    assert convs == [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]] and lines == [1, 3]


def test_missing_input_exits_3_and_bad_options_exit_2(tmp_path, capsys):
    assert regen(tmp_path, tmp_path / "nope.jsonl", tmp_path / "o.jsonl") == 3  # data_error: the data is missing
    assert "does not exist" in capsys.readouterr().err
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "count"}]}])
    assert main(["regenerate", str(inp), str(tmp_path / "o.jsonl")]) == 2
    assert "--target-config" in capsys.readouterr().err
    assert regen(tmp_path, inp, tmp_path / "o.jsonl", "--top-p", "0") == 2
    assert regen(tmp_path, inp, tmp_path / "o.jsonl", "--max-new-tokens", "600") == 2  # > 512 positions
    assert "no room for a prompt" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [inp]


def test_one_prompt_width_gives_every_batch_one_shape_and_the_same_answers(tmp_path, monkeypatch, capsys):
    """--prompt-width-multiple N (N >= the longest prompt): every batch is left-padded to N tokens, so
    compiled decoding sees one prompt shape; the greedy answers are those of the default widths."""
    from dflash.regenerate import hf

    widths = []
    real = hf.TransformersBackend._generate_static

    def spy(self, prompts, params, seed, refill=False):
        widths.append((self.pad_to_multiple_of, self.compile))
        return real(self, prompts, params, seed, refill)

    monkeypatch.setattr(hf.TransformersBackend, "_generate_static", spy)
    rows = [{"messages": c} for c in conversations()[:6]]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    assert regen(tmp_path, inp, tmp_path / "a.jsonl", "--batch-size", "2") == 0
    default = set(widths)
    widths.clear()
    assert regen(tmp_path, inp, tmp_path / "b.jsonl", "--batch-size", "2", "--compile", "off",
                 "--prompt-width-multiple", "96") == 0
    assert default == {(None, False)} and set(widths) == {(96, False)}
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    capsys.readouterr()
    assert regen(tmp_path, inp, tmp_path / "c.jsonl", "--prompt-width-multiple", "0") == 2
    assert "--prompt-width-multiple must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


def test_an_unknown_batching_mode_is_refused_naming_the_modes(target):
    model, tok = target
    with pytest.raises(BadInput, match="batching must be one of static, refill, continuous, got 'paged'"):
        TransformersBackend(model, tok, batching="paged")


def test_cli_output_manifest_and_sharded_ranks(tmp_path, monkeypatch, capsys, target):
    model, tok = target
    convs = conversations()
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    out = tmp_path / "regen.jsonl"
    assert regen(tmp_path, inp, out, "--shard-size", "5", "--batch-size", "3") == 0
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    api, _ = regenerate_conversations(convs, TransformersBackend(model, tok), SamplingParams(max_new_tokens=8))
    assert rows == api  # the CLI built the trainer's target (same seed, same weights)
    manifest = json.loads((tmp_path / "regen.jsonl.manifest.json").read_text())
    assert manifest["counts"]["prompts"] == len(convs) == manifest["counts"]["written"]
    assert manifest["counts"]["regenerated_turns"] == sum(generation_slots(c) for c in convs)
    assert manifest["counts"]["skipped_too_long"] == 0 and manifest["counts"]["generated_tokens"] > 0
    assert manifest["target"]["random_init"]["model_type"] == "qwen3" and manifest["target"]["seed"] == 0
    assert manifest["tokenizer"]["name_or_path"] == "dflash-synthetic-64"
    assert manifest["sampling"] == SamplingParams(max_new_tokens=8).to_dict()
    assert manifest["sharding"] == {"shard_size": 5, "shards": 3, "world_size": 1}
    assert manifest["timings"]["generation_seconds"] > 0
    assert sorted(p.name for p in (tmp_path / "regen.jsonl.parts").iterdir()) == [
        "fingerprint.json", *[f"shard-0000{i}.json{x}" for i in range(3) for x in ("", "l")]]
    # torchrun layout: rank r takes shards i % world == r; rank 0 merges once every shard exists
    ranked = tmp_path / "ranked.jsonl"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert regen(tmp_path, inp, ranked, "--shard-size", "5", "--batch-size", "3") == 0
    assert not ranked.exists() and sorted(p.name for p in (tmp_path / "ranked.jsonl.parts").glob("*.jsonl")) == [
        "shard-00001.jsonl"]
    monkeypatch.setenv("RANK", "0")
    assert regen(tmp_path, inp, ranked, "--shard-size", "5", "--batch-size", "3") == 0
    assert ranked.read_bytes() == out.read_bytes()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    # the parts dir belongs to one run: other parameters are refused
    capsys.readouterr()
    assert regen(tmp_path, inp, out, "--shard-size", "5", "--temperature", "0.7") == 2
    err = capsys.readouterr().err
    assert "different run" in err and "sampling" in err and "delete" in err


def test_kill_9_then_rerun_resumes_and_equals_an_uninterrupted_run(tmp_path):
    convs = [r["messages"] for r in generate_conversations(36, 64, 4, 10, [1, 2], seed=11)]
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    args = ["--target-config", str(TINY), "--max-new-tokens", "16", "--shard-size", "2", "--batch-size", "1"]
    ref = tmp_path / "ref.jsonl"
    assert main(["regenerate", str(inp), str(ref), *args]) == 0

    out = tmp_path / "out.jsonl"
    parts = tmp_path / "out.jsonl.parts"
    cmd = [sys.executable, "-m", "dflash", "regenerate", str(inp), str(out), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(parts.glob("shard-*.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p.name: p.stat().st_mtime_ns for p in parts.glob("shard-*.jsonl")}
    assert 1 <= len(done) < 18 and not out.exists(), "the kill must land between the first and the last shard"

    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(done)} of its 18 shards done before, skipped" in rerun.stderr
    assert {n: (parts / n).stat().st_mtime_ns for n in done} == done  # finished shards were not rewritten
    assert out.read_bytes() == ref.read_bytes()
    first_events = [json.loads(line) for line in rerun.stderr.splitlines() if line.startswith("{")]
    assert first_events[0]["shards_total"] == 18 - len(done)


def test_sigterm_stops_after_finished_shards(tmp_path):
    convs = [r["messages"] for r in generate_conversations(40, 64, 4, 10, [1, 2], seed=5)]
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash", "regenerate", str(inp), str(out), "--target-config", str(TINY),
           "--max-new-tokens", "16", "--shard-size", "2", "--batch-size", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "out.jsonl.parts"
    while not list(parts.glob("shard-*.jsonl")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "stopped by signal 15" in err and "rerun the same command" in err
    assert not out.exists() and not list(parts.glob(".*tmp*"))
    for shard in parts.glob("shard-*.jsonl"):  # every shard file is complete
        assert all(json.loads(line)["messages"] for line in shard.read_text().splitlines())


@pytest.mark.distributed
def test_nproc_starts_torchrun_ranks_and_rank_0_merges(tmp_path):
    convs = conversations()
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    single, ranked = tmp_path / "single.jsonl", tmp_path / "ranked.jsonl"
    args = ["--target-config", str(TINY), "--max-new-tokens", "8", "--shard-size", "3"]
    assert main(["regenerate", str(inp), str(single), *args]) == 0
    r = subprocess.run([sys.executable, "-m", "dflash", "regenerate", str(inp), str(ranked), *args, "--nproc", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "torch.distributed.run --nproc-per-node 2" in r.stderr and "rank 1: done; rank 0 merges" in r.stderr
    assert ranked.read_bytes() == single.read_bytes()
    manifest = json.loads((tmp_path / "ranked.jsonl.manifest.json").read_text())
    assert manifest["sharding"] == {"shard_size": 3, "shards": 4, "world_size": 2}


# ------------------------------------------------------------------------------------ server backend
@pytest.fixture
def server(target):
    model, tok = target
    servers = []

    def start(**kwargs) -> OpenAIServer:
        s = OpenAIServer(model, kwargs.pop("tokenizer", tok), **kwargs).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def test_server_backend_equals_the_transformers_backend(tmp_path, server, capsys):
    convs = conversations()
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    local, served = tmp_path / "local.jsonl", tmp_path / "served.jsonl"
    assert regen(tmp_path, inp, local, "--shard-size", "4") == 0
    srv = server(model_name="tiny-qwen3")
    assert regen(tmp_path, inp, served, "--shard-size", "4", "--server", srv.base_url, "--concurrency", "4") == 0
    assert served.read_bytes() == local.read_bytes()
    manifest = json.loads((tmp_path / "served.jsonl.manifest.json").read_text())
    assert manifest["backend"]["model"] == "tiny-qwen3"  # the only model served, taken without --model
    assert manifest["backend"]["tokenizer_check"].startswith("ok") and "chat template matches" in \
        manifest["backend"]["tokenizer_check"]
    assert manifest["target"]["served_model"] == "tiny-qwen3"
    assert manifest["counts"]["regenerated_turns"] == sum(generation_slots(c) for c in convs)
    assert srv.chat_requests == manifest["counts"]["regenerated_turns"]


@pytest.mark.timeout(600)  # a liveness bound: a backend that retried the refused field forever would hang here
def test_a_server_that_refuses_vllms_extra_fields_gets_requests_without_them(tmp_path, server, capsys):
    """transformers serve (5.24) answers 422 "Unexpected fields in the request: {'skip_special_tokens'}": the
    backend drops the field from then on, and the answers are the same as the local backend's."""
    convs = conversations()
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": c} for c in convs])
    local, served = tmp_path / "local.jsonl", tmp_path / "served.jsonl"
    assert regen(tmp_path, inp, local, "--shard-size", "4") == 0
    capsys.readouterr()
    srv = server(model_name="tiny-qwen3", reject_fields=("skip_special_tokens",), tokenize=False)
    assert regen(tmp_path, inp, served, "--shard-size", "4", "--server", srv.base_url, "--concurrency", "1") == 0
    assert served.read_bytes() == local.read_bytes()
    assert srv.rejected == 1  # refused once, then never sent again
    said = capsys.readouterr()
    assert (said.out + said.err).count("the server refuses skip_special_tokens (HTTP 422)") == 1


def test_server_retries_503_then_fails_clearly(target, server):
    _, tok = target
    convs = conversations()[:3]
    srv = server(fail_first=2)
    backend = OpenAIServerBackend(srv.base_url, "tiny", tok, concurrency=1, retries=3, backoff_s=0.01)
    out, stats = regenerate_conversations(convs, backend, SamplingParams(max_new_tokens=6))
    assert all(c is not None for c in out) and stats.turns == 3
    assert srv.chat_requests == 3 + 2 and srv.failed == 2

    down = server(fail_first=100)
    backend = OpenAIServerBackend(down.base_url, None, tok, retries=2, backoff_s=0.01)
    with pytest.raises(ServerError, match=r"failed 3 times, last: HTTP 503"):
        regenerate_conversations(convs[:1], backend, SamplingParams(max_new_tokens=6))
    with pytest.raises(ServerError, match="connection refused"):  # nothing listening: not retried
        OpenAIServerBackend("http://127.0.0.1:9/v1", None, tok, retries=1, backoff_s=0.01)


def test_server_skips_too_long_prompts_and_tokenize_less_servers(target, server, caplog):
    _, tok = target
    srv = server(max_model_len=30, tokenize=False)
    backend = OpenAIServerBackend(srv.base_url, None, tok, retries=0)
    assert backend.tokenizer_check.startswith("skipped") and backend.max_model_len == 30
    assert "no /tokenize endpoint" in caplog.text
    long = [{"role": "user", "content": "w2 " * 40}]
    ok = [{"role": "user", "content": "count by 2 from w3"}]
    out, stats = regenerate_conversations([long, ok], backend, SamplingParams(max_new_tokens=6))
    assert out[0] is None and out[1] is not None and stats.skipped == 1
    assert srv.chat_requests == 1  # the long prompt was never sent
    unchecked = OpenAIServerBackend(srv.base_url, None, None, retries=0)  # no local tokenizer: the server decides
    out, stats = regenerate_conversations([long, ok], unchecked, SamplingParams(max_new_tokens=6))
    assert out[0] is None and stats.skipped == 1 and srv.chat_requests == 3


def test_wrong_model_or_tokenizer_exits_2(tmp_path, server, capsys):
    inp = write_rows(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "count by 1 from w1"}]}])
    srv = server(model_name="served")
    assert regen(tmp_path, inp, tmp_path / "o.jsonl", "--server", srv.base_url, "--model", "other") == 2
    err = capsys.readouterr().err
    assert "--model 'other' is not served" in err and "served" in err
    other = server(tokenizer=build_tokenizer(48))
    assert regen(tmp_path, inp, tmp_path / "o.jsonl", "--server", other.base_url) == 2
    assert "tokenizer differs from the target's" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [inp]
