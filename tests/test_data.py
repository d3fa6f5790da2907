"""Chat data: formats, assistant-only loss mask, malformed lines, cache; buckets and the sampler."""

import json
from collections import Counter

import pytest
import torch

from dflash.data.buckets import BatchShape, RoundRobinBatchSampler, bucket_length, collate
from dflash.data.chat import load_tokenized, read_jsonl, tokenize_conversation
from dflash.data.synthetic import build_tokenizer, generate_conversations
from dflash.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(32)


def test_loss_mask_covers_assistant_tokens_only(tok):
    messages = [{"role": "system", "content": "you are a counter"},
                {"role": "user", "content": "count by 1 from w3"},
                {"role": "assistant", "content": "w3 w4 w5"},
                {"role": "user", "content": "count by 2 from w0"},
                {"role": "assistant", "content": "w0 w2"}]
    ids, mask, truncated = tokenize_conversation(tok, messages, 512)
    words = tok.convert_ids_to_tokens(ids.tolist())
    masked = [w for w, m in zip(words, mask.tolist(), strict=True) if m]
    assert masked == ["w3", "w4", "w5", "<|im_end|>", "w0", "w2", "<|im_end|>"]
    assert not truncated
    ids2, mask2, truncated2 = tokenize_conversation(tok, messages, 10)
    assert ids2.numel() == 10 and truncated2


def test_sharegpt_and_messages_formats_agree(tmp_path, tok):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(json.dumps({"messages": [{"role": "user", "content": "count by 1 from w1"},
                                          {"role": "assistant", "content": "w1 w2 w3"}]}) + "\n")
    b.write_text(json.dumps({"conversations": [{"from": "human", "value": "count by 1 from w1"},
                                               {"from": "gpt", "value": "w1 w2 w3"}]}) + "\n\n")
    assert read_jsonl(a) == read_jsonl(b)


def test_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": [oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        read_jsonl(p)
    p.write_text('{"messages": [{"role": "wizard", "content": "x"}]}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: turn 0 has unknown role 'wizard'"):
        read_jsonl(p)


def test_missing_file_is_a_data_error(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenized(tmp_path / "nope.jsonl", tok, 64, 1, None)


def test_tokenized_cache_reused_and_short_samples_dropped(tmp_path, tok):
    from dflash.data.synthetic import write_jsonl

    rows = generate_conversations(20, 32, 4, 12, [1], seed=0)
    rows.append({"messages": [{"role": "user", "content": "count by 1 from w1"},
                              {"role": "assistant", "content": "w1"}]})  # 2 loss tokens: dropped
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    first = load_tokenized(path, tok, 64, 4, tmp_path / "cache")
    second = load_tokenized(path, tok, 64, 4, tmp_path / "cache")
    assert first.stats["cache"] == "miss" and second.stats["cache"] == "hit"
    assert first.dropped_few_loss_tokens == 1 and second.dropped_few_loss_tokens == 1
    assert len(first) == len(second) == 20
    for (i1, m1), (i2, m2) in zip(first.samples, second.samples, strict=True):
        assert torch.equal(i1, i2) and torch.equal(m1, m2)


def test_buckets_round_robin_gives_rare_lengths_their_share():
    lengths = [16] * 400 + [64] * 8  # a rare long bucket
    s = RoundRobinBatchSampler(lengths, BatchShape(token_budget=64, bucket_size=16, max_length=64), seed=0)
    batches = s.epoch_batches(0)
    # budget 64: 4 short sequences or 1 long per batch; the 8 long batches come in the first 16 draws
    first16 = [blen for blen, _ in batches[:16]]
    assert Counter(first16) == {16: 8, 64: 8}
    assert all(len(idx) * blen <= 64 for blen, idx in batches)
    # the bounds the sampler publishes (the transfer buffers' size) hold every batch it cuts
    assert max(len(idx) for _, idx in batches) == s.max_rows == 4
    assert all(len(idx) * blen <= s.max_tokens for blen, idx in batches)
    assert sorted(i for _, idx in batches for i in idx) == list(range(408))  # every sample once per epoch


def test_sampler_resume_continues_exactly():
    lengths = [10, 20, 30, 40] * 10
    a = RoundRobinBatchSampler(lengths, BatchShape(64, 16, 64), seed=3)
    seq = [a.next() for _ in range(30)]
    b = RoundRobinBatchSampler(lengths, BatchShape(64, 16, 64), seed=3)
    for _ in range(11):
        b.next()
    c = RoundRobinBatchSampler(lengths, BatchShape(64, 16, 64), seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next() for _ in range(19)] == seq[11:]
    assert seq[-1][0] >= 1  # crossed into another epoch


def test_sampler_shards_batches_evenly_across_ranks():
    lengths = [16] * 50
    shards = [RoundRobinBatchSampler(lengths, BatchShape(64, 16, 64), seed=0, rank=r, world_size=3).epoch_batches(0)
              for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    seen = [i for s in shards for _, idx in s for i in idx]
    assert len(seen) == len(set(seen))


def test_padding_share_counts_the_positions_the_buckets_add():
    shape = BatchShape(token_budget=12288, bucket_size=512, max_length=3072)
    # 2600 -> 3072 (472 padded), 3072 -> 3072 (none), 3100 truncated to 3072 (none), 100 -> 512 (412)
    lengths = [2600, 3072, 3100, 100]
    assert shape.padding_share(lengths) == pytest.approx((472 + 412) / (3 * 3072 + 512))
    finer = BatchShape(token_budget=12288, bucket_size=128, max_length=3072)
    assert finer.padding_share(lengths) < shape.padding_share(lengths)
    assert finer.padding_share([2688, 128]) == 0.0
    assert shape.padding_share([]) == 0.0


def test_bucket_length_and_collate():
    assert bucket_length(17, 16, 64) == 32 and bucket_length(70, 16, 64) == 64
    samples = [(torch.tensor([1, 2, 3]), torch.tensor([False, True, True])), (torch.tensor([4]), torch.tensor([True]))]
    b = collate(samples, [0, 1], 4, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert b.lengths.tolist() == [3, 1] and b.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
