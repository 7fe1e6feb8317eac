import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mmcache import Fingerprint, page_names
from mmcache.errors import InvalidRequest
from mmcache.names import as_tokens, chain, chain_root

FP = Fingerprint(model="org/m@rev", page_size=4)
TOKENS = list(range(10, 23))  # 13 tokens: 3 full pages and a 1-token tail


def test_one_name_per_full_page_and_stable_across_runs():
    names = page_names(FP, TOKENS)
    assert len(names) == 3 and len(set(names)) == 3
    assert names == page_names(FP, np.array(TOKENS, dtype=np.int64)) == page_names(FP, torch.tensor(TOKENS))
    # Pinned: names must not change between runs, machines or releases (a cache of names outlives a process).
    assert FP.root == 0x1D076E65064B98D1
    assert names == [0x88C2C3632C98FFA5, 0x057E2475A8CCA64C, 0x40E899AD5795214D]


@pytest.mark.parametrize("field,value", [("model", "org/m@rev2"), ("tp_rank", 1), ("tp_size", 2),
                                         ("kv_dtype", "float8_e4m3fn"), ("attention_backend", "eager"),
                                         ("page_size", 8), ("extra", "rope-scaling=2")])
def test_every_fingerprint_field_changes_the_root(field, value):
    other = dataclasses.replace(FP, **{field: value})
    assert other.root != FP.root
    assert page_names(other, TOKENS)[:1] != page_names(FP, TOKENS)[:1] or field == "page_size"


def test_torch_dtype_is_accepted_as_kv_dtype():
    assert Fingerprint("m", kv_dtype=torch.bfloat16).root == Fingerprint("m", kv_dtype="bfloat16").root


def test_salt_changes_every_name():
    plain, salted = page_names(FP, TOKENS), page_names(FP, TOKENS, salt=b"tenant-a")
    assert not set(plain) & set(salted)
    assert page_names(FP, TOKENS, salt=b"tenant-b") != salted


def test_media_changes_names_from_its_first_placeholder_page_on():
    base = page_names(FP, TOKENS)
    img_a = page_names(FP, TOKENS, media=[(5, b"A" * 16)])
    img_b = page_names(FP, TOKENS, media=[(5, b"B" * 16)])
    assert img_a[0] == base[0] and img_a[1] != base[1] and img_a[2] != base[2]
    assert img_a[1:] != img_b[1:]
    # an int digest and its 16 little-endian bytes are the same digest
    assert page_names(FP, TOKENS, media=[(5, 7)]) == page_names(FP, TOKENS, media=[(5, (7).to_bytes(16, "little"))])
    # two images swapped inside one page are different media
    ab = page_names(FP, TOKENS, media=[(4, b"A"), (6, b"B")])
    ba = page_names(FP, TOKENS, media=[(4, b"B"), (6, b"A")])
    assert ab[1] != ba[1]
    # media in the tail page names nothing
    assert page_names(FP, TOKENS, media=[(12, b"C")]) == base


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=40), st.lists(st.integers(0, 50_000), max_size=40))
def test_extending_a_chain_equals_naming_the_whole_sequence(prompt, output):
    whole = page_names(FP, prompt + output)
    head = page_names(FP, prompt)
    start = len(head)
    tail = chain(head[-1] if head else chain_root(FP), as_tokens((prompt + output)[start * 4:]), 4, start)
    assert head + tail == whole


@pytest.mark.parametrize("bad", [[1.5, 2.0], [-1, 3], [2**31], ["a"], [True, False]])
def test_bad_tokens_are_refused(bad):
    with pytest.raises(InvalidRequest):
        page_names(FP, bad)


@pytest.mark.parametrize("media", [[(99, b"x")], [(-1, b"x")], [(1,)], [(1, 3.5)], [(1, -5)]])
def test_bad_media_marks_are_refused(media):
    with pytest.raises(InvalidRequest):
        page_names(FP, TOKENS, media=media)


def test_salt_must_be_bytes():
    with pytest.raises(InvalidRequest):
        page_names(FP, TOKENS, salt="tenant")


@given(st.lists(st.integers(0, 2**31 - 2), max_size=64))
def test_list_fast_path_equals_the_array_path(ids):
    fast, slow = as_tokens(ids), as_tokens(np.array(ids, dtype=np.int64))
    assert fast.dtype == slow.dtype == np.int32 and fast.flags.c_contiguous and (fast == slow).all()
