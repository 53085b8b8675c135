"""SamplingParams / Request validation, request block hashing and RequestStatus."""

from __future__ import annotations

import math

import pytest

from engine.core.kv_cache_utils import hash_block_tokens, make_block_hasher, sha256_digest
from engine.request import MAX_TOKEN_ID, Request, RequestStatus, SamplingParams

BLOCK_SIZE = 4


def hashed_request(
    request_id: str, tokens: list[int], cache_salt: str | None = None, block_size: int = BLOCK_SIZE
) -> Request:
    req = Request(request_id, tokens, SamplingParams(), cache_salt=cache_salt)
    req.set_block_hasher(make_block_hasher(block_size, sha256_digest), block_size)
    return req


# --- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"stop": "</s>"}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: "big"}}, "logit_bias"),
    ],
)
def test_sampling_params_rejects_bad_value_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"temperature": 0.0},
        {"max_tokens": 1},
        {"max_tokens": 4, "min_tokens": 4},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logit_bias": {0: -100.0, 7: 100}},
        {"stop": ["a", "bc"]},
    ],
)
def test_sampling_params_accepts_edge_values(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(params, name) == expected


def test_sampling_params_greedy_only_at_zero_temperature() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_sampling_params_copies_stop_sequences() -> None:
    stop = ["x"]
    stop_ids = [3, 4]
    params = SamplingParams(stop=stop, stop_token_ids=stop_ids)
    stop.append("y")
    stop_ids.append(5)
    assert params.stop == ("x",)
    assert params.stop_token_ids == (3, 4)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_sampling_params_rejects_nan(field: str) -> None:
    # NaN compares False with everything, so a `value < 0` check alone lets it through.
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: math.nan})


# --- Request validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_id", "prompt", "params", "needle"),
    [
        ("r", [], SamplingParams(), "empty"),
        ("r", [1, -1, 2], SamplingParams(), "token ids"),
        ("r", [1, MAX_TOKEN_ID], SamplingParams(), "token ids"),
        ("r", [1, 2**31], SamplingParams(), "token ids"),
        ("r", [1, 2.0], SamplingParams(), "token ids"),
        ("r", [1, True], SamplingParams(), "token ids"),
        ("r", [1, "2"], SamplingParams(), "token ids"),
        ("", [1, 2], SamplingParams(), "request_id"),
        (None, [1, 2], SamplingParams(), "request_id"),
        ("r", [1, 2], {"max_tokens": 4}, "sampling_params"),
        ("r", [1, 2], None, "sampling_params"),
    ],
)
def test_request_rejects_bad_inputs(request_id, prompt, params, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Request(request_id, prompt, params)


def test_request_accepts_largest_token_id_and_tracks_counts() -> None:
    req = Request("r", [0, MAX_TOKEN_ID - 1], SamplingParams(max_tokens=7))
    assert req.num_prompt_tokens == 2
    assert req.num_tokens == 2
    assert req.max_tokens == 7
    assert req.status == RequestStatus.WAITING
    req.append_output_token_ids(9)
    assert req.num_tokens == 3
    assert req.num_output_tokens == 1
    assert req.all_token_ids == [0, MAX_TOKEN_ID - 1, 9]
    assert req.prompt_token_ids == [0, MAX_TOKEN_ID - 1]


# --- Block hashing --------------------------------------------------------------------------


@pytest.mark.parametrize("num_prompt_tokens", [1, 3, 4, 5, 8, 11, 12])
def test_prompt_gets_one_hash_per_full_block(num_prompt_tokens: int) -> None:
    req = hashed_request("r", list(range(1, num_prompt_tokens + 1)))
    assert len(req.block_hashes) == num_prompt_tokens // BLOCK_SIZE


def test_prompt_hashes_match_chained_hash_of_each_block() -> None:
    tokens = list(range(100, 110))
    req = hashed_request("r", tokens)
    h0 = hash_block_tokens(sha256_digest, None, tokens[0:4])
    h1 = hash_block_tokens(sha256_digest, h0, tokens[4:8])
    assert req.block_hashes == [h0, h1]


def test_output_tokens_add_exactly_one_hash_when_block_fills() -> None:
    req = hashed_request("r", [1, 2, 3, 4, 5, 6])  # 1 full block, 2 tokens into the next
    assert len(req.block_hashes) == 1
    expected_counts = []
    actual_counts = []
    for i in range(14):  # tokens 7..20: blocks fill at num_tokens 8, 12, 16, 20
        req.append_output_token_ids(1000 + i)
        expected_counts.append(req.num_tokens // BLOCK_SIZE)
        actual_counts.append(len(req.block_hashes))
    assert actual_counts == expected_counts
    assert actual_counts == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    # The incremental hashes equal hashing the final sequence from scratch.
    fresh = hashed_request("r2", req.all_token_ids)
    assert fresh.block_hashes == req.block_hashes


def test_output_tokens_hash_from_block_aligned_prompt() -> None:
    req = hashed_request("r", [1, 2, 3, 4])
    assert len(req.block_hashes) == 1
    for token in (5, 6, 7):
        req.append_output_token_ids(token)
        assert len(req.block_hashes) == 1
    req.append_output_token_ids(8)
    assert len(req.block_hashes) == 2
    assert req.block_hashes[1] == hash_block_tokens(
        sha256_digest, req.block_hashes[0], [5, 6, 7, 8]
    )


def test_hashes_are_chained_on_prefix() -> None:
    same_block = [9, 9, 9, 9]
    a = hashed_request("a", [1, 2, 3, 4, *same_block])
    b = hashed_request("b", [1, 2, 3, 5, *same_block])
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]


def test_same_prefix_gives_equal_hashes_across_requests() -> None:
    a = hashed_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = hashed_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    assert a.block_hashes == b.block_hashes[:2]
    assert len(b.block_hashes) == 3


def test_cache_salt_changes_every_hash_of_the_chain() -> None:
    tokens = list(range(1, 13))
    plain = hashed_request("p", tokens)
    salted = hashed_request("s", tokens, cache_salt="tenant-a")
    other = hashed_request("o", tokens, cache_salt="tenant-b")
    assert len(plain.block_hashes) == len(salted.block_hashes) == len(other.block_hashes) == 3
    for p, s, o in zip(plain.block_hashes, salted.block_hashes, other.block_hashes, strict=True):
        assert len({p, s, o}) == 3


def test_same_cache_salt_shares_hashes() -> None:
    tokens = list(range(1, 13))
    a = hashed_request("a", tokens, cache_salt="tenant-a")
    b = hashed_request("b", tokens, cache_salt="tenant-a")
    assert a.block_hashes == b.block_hashes
    a.append_output_token_ids(50)
    b.append_output_token_ids(50)
    assert a.block_hashes == b.block_hashes


# --- RequestStatus --------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(RequestStatus))
def test_status_is_finished_exactly_for_finished_statuses(status: RequestStatus) -> None:
    assert status.is_finished == status.name.startswith("FINISHED_")
    req = Request("r", [1], SamplingParams())
    req.status = status
    assert req.is_finished == status.name.startswith("FINISHED_")


def test_status_has_five_finished_members() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
        RequestStatus.FINISHED_ERROR,
    }
