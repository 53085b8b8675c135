"""Which slice of the model each tensor-parallel rank holds, and which sizes are refused."""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace

import pytest

from engine.arg_utils import EngineArgs
from engine.core.sched_output import CachedRequestData, SchedulerOutput
from engine.models.config import ModelArchConfig, RopeConfig
from engine.parallel.layout import SKIP, TPLayout, check_tensor_parallel
from engine.parallel.workers import TensorParallelError, _run_steps

# SmolLM2-135M's shape: 9 q heads, 3 KV heads, 64 per head, MLP 1536, vocabulary 49152.
SMOLLM2 = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope=RopeConfig(),
)
LAYER = "model.layers.4"


def test_three_ranks_split_heads_mlp_and_vocabulary():
    rank1 = TPLayout(SMOLLM2, 1, 3)
    assert (rank1.num_heads, rank1.num_kv_heads, rank1.first_kv_head) == (3, 1, 1)
    assert rank1.tensor_slice(f"{LAYER}.self_attn.q_proj.weight") == (0, 192, 384)
    assert rank1.tensor_slice(f"{LAYER}.self_attn.k_proj.weight") == (0, 64, 128)
    assert rank1.tensor_slice(f"{LAYER}.self_attn.v_proj.weight") == (0, 64, 128)
    assert rank1.tensor_slice(f"{LAYER}.self_attn.o_proj.weight") == (1, 192, 384)
    assert rank1.tensor_slice(f"{LAYER}.mlp.gate_proj.weight") == (0, 512, 1024)
    assert rank1.tensor_slice(f"{LAYER}.mlp.down_proj.weight") == (1, 512, 1024)
    assert rank1.tensor_slice("model.embed_tokens.weight") == (0, 16384, 32768)
    assert rank1.tensor_slice(f"{LAYER}.input_layernorm.weight") is None  # whole
    assert TPLayout(SMOLLM2).tensor_slice(f"{LAYER}.self_attn.q_proj.weight") is None


def test_row_parallel_biases_belong_to_rank_0_only():
    qwen = replace(SMOLLM2, o_bias=True, mlp_bias=True)
    assert TPLayout(qwen, 0, 3).tensor_slice(f"{LAYER}.self_attn.o_proj.bias") is None
    assert TPLayout(qwen, 2, 3).tensor_slice(f"{LAYER}.self_attn.o_proj.bias") == SKIP
    assert TPLayout(qwen, 1, 3).tensor_slice(f"{LAYER}.mlp.down_proj.bias") == SKIP
    # A column-parallel bias is split like its rows.
    assert TPLayout(qwen, 1, 3).tensor_slice(f"{LAYER}.self_attn.q_proj.bias") == (0, 192, 384)


def test_kv_heads_fewer_than_ranks_are_replicated_to_the_ranks_that_read_them():
    # 8 q heads, 2 KV heads, 4 ranks: q heads 0-3 read KV head 0, 4-7 KV head 1.
    arch = replace(SMOLLM2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024)
    firsts = [TPLayout(arch, rank, 4).first_kv_head for rank in range(4)]
    assert firsts == [0, 0, 1, 1]
    assert TPLayout(arch, 3, 4).tensor_slice(f"{LAYER}.self_attn.k_proj.weight") == (0, 64, 128)


def test_an_uneven_vocabulary_pads_the_last_rank():
    arch = replace(SMOLLM2, vocab_size=49153)
    last = TPLayout(arch, 2, 3)
    assert last.vocab_rows == 16385
    assert last.tensor_slice("lm_head.weight") == (0, 32770, 49155)  # 2 rows past the end


@pytest.mark.parametrize(
    ("size", "words"),
    [(2, "9 attention heads"), (6, "9 attention heads"), (9, "MLP width 1536"), (0, "at least 1")],
)
def test_sizes_that_do_not_divide_the_model_are_refused(size, words):
    with pytest.raises(ValueError, match=words):
        check_tensor_parallel(SMOLLM2, size)
    with pytest.raises(ValueError, match=words):
        TPLayout(SMOLLM2, 0, size)
    # KV heads that neither divide among the ranks nor replicate evenly to them.
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel(replace(SMOLLM2, num_attention_heads=12), 2)


def test_engine_args_refuse_the_kv_cache_layouts_the_ranks_cannot_have():
    # tiny: 4 KV heads. At 8 ranks they replicate: no cache of every head to share, but KV
    # transfer works (a cache per rank, connector/kv_shards.py).
    config, _ = EngineArgs(
        tensor_parallel_size=8, kv_transfer_config={}, device="cpu"
    ).create_engine_config()
    assert config.kv_transfer is not None
    with pytest.raises(ValueError, match="'shared' needs device cpu and the model's 4 KV"):
        EngineArgs(tensor_parallel_size=8, tensor_parallel_kv_cache="shared").create_engine_config()
    # The KV tier takes a block of every rank's cache (rank 0 maps them).
    config, _ = EngineArgs(
        tensor_parallel_size=2, tensor_parallel_kv_cache="per_rank", kv_offloading_size=0.01
    ).create_engine_config()
    assert config.parallel.kv_cache == "per_rank" and config.cache.kv_offloading_size == 0.01
    with pytest.raises(ValueError, match="tensor_parallel_kv_cache must be one of"):
        EngineArgs(tensor_parallel_kv_cache="mirrored").create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        EngineArgs(tensor_parallel_size=3).create_engine_config()  # tiny: 8 heads
    with pytest.raises(ValueError, match="collectives must be one of"):
        EngineArgs(tensor_parallel_collectives="mpi").create_engine_config()
    config, _ = EngineArgs(tensor_parallel_size=2).create_engine_config()
    assert config.parallel.tensor_parallel_size == 2


class _Runner:
    """Samples token 1 for every request, whatever rank 0 sampled."""

    def execute_model(self, so: SchedulerOutput):
        from engine.core.sched_output import ModelRunnerOutput

        return ModelRunnerOutput(["a"], [[1]])


def test_a_rank_that_sampled_other_tokens_than_rank_0_stops():
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    step = SchedulerOutput([], CachedRequestData(), {}, 0, set(), set())
    ours.send_bytes(pickle.dumps((step, None)))  # first step: nothing to compare yet
    ours.send_bytes(pickle.dumps((step, (["a"], [[1]]))))  # agrees
    ours.send_bytes(pickle.dumps((step, (["a"], [[2]]))))  # rank 0 sampled 2
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            _run_steps(theirs, _Runner())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], TensorParallelError)
    assert "other tokens than rank 0" in str(failure[0])


def test_each_rank_gets_a_share_of_cores_of_its_own():
    from engine.parallel.layout import cores_by_rank

    assert cores_by_rank([4, 0, 1, 2, 3], 2, 2) == [(0, 1), (3, 4)]  # core 2 left over
    assert cores_by_rank([0, 1, 2], 3, 1) == [(0,), (1,), (2,)]
    assert cores_by_rank([0, 1], 3, 1) == [(), (), ()]  # too few: nobody is pinned
