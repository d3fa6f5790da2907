"""Topology planning, device checks, transfer buffers and the torchrun command, without starting processes."""

import itertools
from collections import Counter

import pytest
import torch

from dflash.cli import main
from dflash.config import TopologyConfig, _build, validate
from dflash.data.buckets import Batch, BatchShape, RoundRobinBatchSampler
from dflash.errors import BadInput, ConfigError
from dflash.launch import apply_rendezvous_env, torchrun_command
from dflash.runtime import topology
from dflash.runtime.topology import check_devices, plan_ranks
from dflash.runtime.transfer import ItemSchedule, Slot, TransferLayout


def test_colocated_plan_every_rank_is_a_drafter_rank():
    plan = plan_ranks(TopologyConfig(mode="colocated", nproc=4, nnodes=2))
    assert plan.world_size == 8 and plan.drafter_ranks == tuple(range(8)) and plan.target_ranks == ()
    assert plan.reporter == 0 and plan.gpu_of(5) == 1


def test_disaggregated_plan_same_layout_on_every_node():
    plan = plan_ranks(TopologyConfig(mode="disaggregated", target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7],
                                     nnodes=2))
    assert plan.nproc_per_node == 8 and plan.world_size == 16
    assert plan.target_ranks == (0, 1, 2, 3, 4, 8, 9, 10, 11, 12)
    assert plan.drafter_ranks == (5, 6, 7, 13, 14, 15)
    assert plan.reporter == 5 and plan.gpu_of(13) == 5 and plan.gpu_of(9) == 1
    assert plan.describe(14) == "drafter rank 4/6"


@pytest.mark.parametrize("targets,drafters", [(1, 2), (5, 3), (2, 4), (3, 3)])
def test_every_drafter_is_fed_evenly_by_every_producer(targets, drafters):
    schedule = ItemSchedule(tuple(range(targets)), tuple(range(targets, targets + drafters)), 0, 60)
    per_producer = Counter(schedule.producer(d, n) for d in range(drafters) for n in range(60))
    assert set(per_producer) == set(range(targets))
    assert max(per_producer.values()) - min(per_producer.values()) <= 1


def test_global_batch_is_the_same_for_any_split():
    """Rank d of D, micro-batch k reads item k*D + d of each global batch, as one rank with grad_accum D*m."""
    lengths = [16 + (i * 7) % 40 for i in range(300)]
    one = RoundRobinBatchSampler(lengths, BatchShape(256, 16, 64), seed=3, multiple_of=4)
    ranks = [RoundRobinBatchSampler(lengths, BatchShape(256, 16, 64), seed=3, rank=d, world_size=2, multiple_of=2)
             for d in range(2)]
    assert one.batches_per_epoch() == 2 * ranks[0].batches_per_epoch()
    for _ in range(3 * one.batches_per_epoch() // 4):  # three epochs of steps
        single = [one.next() for _ in range(4)]
        split = [None] * 4
        for k, d in itertools.product(range(2), range(2)):
            split[k * 2 + d] = ranks[d].next()
        assert single == split
        assert len({e for e, _, _ in single}) == 1  # a step never straddles two epochs


def test_slot_round_trip_keeps_batch_and_features():
    layout = TransferLayout.for_batches(BatchShape(token_budget=64, bucket_size=16, max_length=32), feature_dim=6,
                                        feature_dtype=torch.bfloat16)
    assert layout.max_rows == 4 and layout.max_tokens == 64
    ids = torch.randint(0, 50, (2, 32))
    mask = torch.rand(2, 32) > 0.5
    lengths = torch.tensor([32, 20])
    attn = (torch.arange(32)[None] < lengths[:, None]).long()
    feats = torch.randn(2, 32, 6).to(torch.bfloat16)
    slot = Slot.allocate(layout, torch.device("cpu"))
    slot.pack(3, 17, Batch(ids, mask, attn, lengths, [0, 1]), feats)
    epoch, seq, batch, got = slot.unpack()
    assert (epoch, seq) == (3, 17)
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.loss_mask, mask)
    assert torch.equal(batch.attention_mask, attn) and torch.equal(batch.lengths, lengths)
    assert torch.equal(got, feats)
    with pytest.raises(RuntimeError, match="exceeds the transfer buffers"):
        slot.pack(0, 0, Batch(torch.zeros(5, 16, dtype=torch.long), torch.zeros(5, 16, dtype=torch.bool),
                              torch.zeros(5, 16, dtype=torch.long), torch.full((5,), 16), []),
                  torch.zeros(5, 16, 6))


def _config(tiny_dict, **topology_keys):
    tiny_dict["topology"] = topology_keys
    tiny_dict["data"].pop("regenerate", None)  # colocated ranks only; not what these tests are about
    cfg = _build(__import__("dflash.config", fromlist=["RunConfig"]).RunConfig, tiny_dict, "")
    validate(cfg)
    return cfg


def test_gpu_ids_are_checked_against_visible_devices(tiny_dict, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    tiny_dict["runtime"]["device"] = "cuda"
    too_many = _config(tiny_dict, mode="colocated", nproc=4)
    with pytest.raises(BadInput, match=r"topology.nproc asks for 4 ranks .* only 2 GPU\(s\) are visible "
                                       r"\(CUDA_VISIBLE_DEVICES=0,1\)"):
        check_devices(too_many, plan_ranks(too_many.topology))
    unknown = _config(tiny_dict, mode="disaggregated", target_gpus=[3], drafter_gpus=[1])
    with pytest.raises(BadInput, match=r"GPU ids \[3\] but only ids 0..1 are visible"):
        check_devices(unknown, plan_ranks(unknown.topology))
    fine = _config(tiny_dict, mode="disaggregated", target_gpus=[1], drafter_gpus=[0])
    check_devices(fine, plan_ranks(fine.topology))


def test_target_that_cannot_fit_a_gpu_is_refused(tiny_dict, monkeypatch):
    class Props:
        total_memory = 1 << 19  # 512 KiB: less than the tiny target (~0.9 MiB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i: Props())
    tiny_dict["runtime"]["device"] = "cuda"
    cfg = _config(tiny_dict, mode="disaggregated", target_gpus=[0], drafter_gpus=[1])
    assert topology.target_weight_bytes(cfg) > 1 << 19
    with pytest.raises(BadInput, match=r"the target's weights need 0\.\d+ MiB but GPU 0 has 0\.50 MiB; split the "
                       r"target by layers .*topology.target_stages=3"):
        topology.check_target_fits(cfg, plan_ranks(cfg.topology))
    split = _config(tiny_dict, mode="disaggregated", target_gpus=[0, 1, 2], drafter_gpus=[3], target_stages=3)
    topology.check_target_fits(split, plan_ranks(split.topology))  # a third of it fits


def test_cli_refuses_cuda_topology_without_gpus_with_exit_2(write_config, tiny_dict, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tiny_dict["runtime"]["device"] = "cuda"
    tiny_dict["topology"] = {"mode": "colocated", "nproc": 2}
    assert main(["train", str(write_config(tiny_dict))]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_topology_values_are_validated(tiny_dict):
    with pytest.raises(ConfigError, match="node_rank 2 is outside 0..1"):
        _config(tiny_dict, nnodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="max_inflight must be >= 1"):
        _config(tiny_dict, max_inflight=0)
    with pytest.raises(ConfigError, match=r"GPUs \[1\] are in both"):
        _config(tiny_dict, mode="disaggregated", target_gpus=[0, 1], drafter_gpus=[1])
    with pytest.raises(ConfigError, match="target_stages splits the target .* needs topology.mode=disaggregated"):
        _config(tiny_dict, mode="colocated", nproc=2, target_stages=2)
    with pytest.raises(ConfigError, match=r"3 target ranks cannot form replicas of topology.target_stages=2"):
        _config(tiny_dict, mode="disaggregated", target_gpus=[0, 1, 2], drafter_gpus=[3], target_stages=2)


def test_layer_split_plan_producers_are_the_last_stages():
    plan = plan_ranks(TopologyConfig(mode="disaggregated", target_gpus=[0, 1, 2, 3], drafter_gpus=[4, 5],
                                     target_stages=2, nnodes=2))
    assert plan.target_ranks == (0, 1, 2, 3, 6, 7, 8, 9) and plan.drafter_ranks == (4, 5, 10, 11)
    assert plan.producers == (1, 3, 7, 9)
    assert [plan.replica_ranks(r) for r in range(4)] == [(0, 1), (2, 3), (6, 7), (8, 9)]
    assert (plan.replica_of(7), plan.stage_of(7), plan.stage_of(6)) == (2, 1, 0)
    assert plan.describe(3) == "target rank 3/8 (stage 1/2 of replica 1)"
    schedule = ItemSchedule(plan.producers, plan.drafter_ranks, 0, 2)
    made = Counter(p for _, _, p in schedule.items())
    assert set(made) == set(plan.producers) and len(set(made.values())) == 1  # producers fed evenly


def test_torchrun_command_single_node_and_rendezvous(tiny_dict, monkeypatch):
    cfg = _config(tiny_dict, mode="colocated", nproc=2)
    cmd = torchrun_command(cfg, "run.yaml", ["optim.lr=1e-3"], 2)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"] and "--standalone" in cmd
    assert cmd[-4:-1] == ["dflash", "train", cmd[-2]] and cmd[-1] == "optim.lr=1e-3"
    monkeypatch.setenv("DFLASH_NNODES", "2")
    monkeypatch.setenv("DFLASH_NODE_RANK", "1")
    monkeypatch.setenv("DFLASH_MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("DFLASH_RUN_ID", "qwen3-8b")
    apply_rendezvous_env(cfg)
    cmd = " ".join(torchrun_command(cfg, "run.yaml", [], 2))
    # static rendezvous on node 0's c10d store: the node ranks stay as given; the run id names the store's keys
    assert ("--nnodes 2 --node-rank 1 --rdzv-backend static --rdzv-endpoint 10.0.0.5:29512 --rdzv-id qwen3-8b "
            "--rdzv-conf timeout=600") in cmd
    monkeypatch.delenv("DFLASH_RUN_ID")
    assert f"--rdzv-id {cfg.output_dir.rstrip('/').rsplit('/', 1)[-1]} " in " ".join(torchrun_command(cfg, "run.yaml", [], 2))
    assert "--standalone" not in cmd
    monkeypatch.setenv("DFLASH_NODE_RANK", "x")
    with pytest.raises(BadInput, match="DFLASH_NODE_RANK='x' is not an integer"):
        apply_rendezvous_env(cfg)


def test_external_torchrun_with_wrong_process_count_is_bad_input(tiny_dict, monkeypatch):
    from dflash.training.worker import run_rank

    cfg = _config(tiny_dict, mode="colocated", nproc=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(BadInput, match="torchrun started 3 processes"):
        run_rank(cfg)


def test_transfer_size_of_the_8b_topology_config_is_the_documented_one():
    """bench/p2p_bench.py sizes its messages like the trainer; docs/PERFORMANCE.md quotes this figure."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("p2p_bench", root / "bench" / "p2p_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    layout = bench.layout_for(str(root / "tests/distributed/configs/gpu-8b.yaml"), None)
    # 12288 tokens x 5 tapped layers x 4096 hidden in bf16, plus tokens and meta (24 rows max)
    assert (layout.max_rows, layout.max_tokens, layout.feature_dim) == (24, 12288, 5 * 4096)
    assert layout.bytes_per_item() == 12288 * 20480 * 2 + 8 * (4 + 24 + 2 * 12288) == 503_513_312
