import pytest
import torch

from eyas.inference.bench_report import memory_line
from eyas.inference.memory_limit import MemoryLimit, read_bandwidth, weight_bytes
from tests.helpers.tiny import tiny_model


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_count_what_a_step_reads(tied):
    model = tiny_model("llama", tied=tied).to(torch.bfloat16)
    # by name: a tied lm_head is the embedding (named once); an untied input embedding is read one row a step
    named = {n: p for n, p in model.named_parameters()}
    expected = sum(p.numel() * 2 for n, p in named.items() if tied or "embed_tokens" not in n)
    assert ("lm_head.weight" in named) != tied
    assert weight_bytes(model) == expected


def test_read_bandwidth_is_a_rate_of_a_named_kernel():
    rate, kernel = read_bandwidth(gib=1 / 64, repeats=2)
    assert kernel in ("sum", "amax", "mv")
    assert 1e8 < rate < 1e13  # bytes per second: between 0.1 GB/s and 10 TB/s


def test_a_lone_fast_read_does_not_set_the_limit_and_two_reads_keep_the_faster(monkeypatch):
    import eyas.inference.memory_limit as memory_limit

    rates = iter([(30e9, "sum"), (58e9, "sum"), (32e9, "amax"), (31e9, "mv")])
    monkeypatch.setattr(memory_limit, "read_bandwidth", lambda device: next(rates))
    reads = memory_limit.ReadRate()
    with pytest.raises(ValueError, match="no bandwidth sample"):
        reads.limit(1)
    reads.sample(), reads.sample()
    assert reads.limit(1).bandwidth == 58e9  # two reads: the faster, the strictest limit
    reads.sample(), reads.sample()
    limit = reads.limit(500_000_000)  # four: the upper median, the 58 GB/s read a spike among 30-32
    assert (limit.bandwidth, limit.kernel, limit.samples, limit.low, limit.high) == (32e9, "amax", 4, 30e9, 58e9)


def test_the_limit_and_the_share_each_plain_runtime_reached():
    fast = MemoryLimit(25e9, "mv", 500_000_000, 3, 24e9, 26e9)
    assert fast.tokens_per_s == pytest.approx(50.0)
    runtimes = {"baseline": {"label": "generate", "tokens_per_s": 10.0},
                "spec": {"label": "eyas", "tokens_per_s": 80.0},
                "eyas_plain": {"label": "eyas plain", "tokens_per_s": 40.0},
                "vllm_plain": {"label": "vLLM plain", "tokens_per_s": 30.0}}
    line = memory_line(fast.as_dict(), runtimes)
    assert "50.0 tok/s" in line and "500 MB" in line and "25.0 GB/s" in line and "3 reads" in line
    assert "(24.0-26.0)" in line
    assert line.endswith("generate 20 %, eyas plain 80 %, vLLM plain 60 %")  # plain runtimes only
