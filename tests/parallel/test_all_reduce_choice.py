"""Which TP all-reduce carries a message: the symmetric buffer only where its kernels apply."""

import torch

from tokenmill.distributed.symm_all_reduce import AllReduceLimits, SymmetricAllReduce, choose_method

LIMITS = AllReduceLimits(max_bytes=8 << 20, one_shot_bytes=1 << 20)


def test_small_messages_take_one_shot_then_two_shot_then_nccl():
    assert choose_method(64 * 4096 * 2, torch.bfloat16, LIMITS) == "one_shot"  # decode, batch 64
    assert choose_method(1 << 20, torch.bfloat16, LIMITS) == "one_shot"
    assert choose_method((1 << 20) + 16, torch.bfloat16, LIMITS) == "two_shot"
    assert choose_method(8 << 20, torch.float32, LIMITS) == "two_shot"
    assert choose_method((8 << 20) + 16, torch.bfloat16, LIMITS) == "nccl"  # a prefill chunk


def test_what_the_kernels_cannot_take_goes_to_nccl():
    assert choose_method(4096, torch.float16, LIMITS) == "nccl"  # no float16 kernel
    assert choose_method(4 * 3, torch.float32, LIMITS) == "nccl"  # not a multiple of 16 bytes
    assert choose_method(0, torch.bfloat16, LIMITS) == "nccl"
    assert choose_method(4096, torch.bfloat16, None) == "nccl"  # no buffer (CPU, no peer access)


def test_no_symmetric_buffer_off_cuda(monkeypatch):
    assert SymmetricAllReduce.create(None, torch.device("cpu")) is None
    monkeypatch.setenv("TOKENMILL_ALL_REDUCE", "nccl")
    assert SymmetricAllReduce.create(None, torch.device("cuda", 0)) is None
